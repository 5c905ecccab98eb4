"""Bad input on one rank: every rank raises the same error naming that rank, and no hang."""

from __future__ import annotations

import re

import numpy as np
import pytest

import sparsecoll
from sparsecoll.registry import algorithm_class

from .. import fakecupy
from .cases import assert_all

NAMES = sparsecoll.available_algorithms()
N = 1000


def _good(rank: int):
    rng = np.random.default_rng(rank)
    idx = rng.integers(0, N, 20).astype(np.int64)
    return rng.standard_normal(20).astype(np.float32), idx


def _spoil(what: str, vals, idx, n):
    if what == "out_of_range":
        idx = idx.copy()
        idx[3] = n + 5
    elif what == "negative":
        idx = idx.copy()
        idx[0] = -1
    elif what == "n":
        n = n + 1
    elif what == "dtype":
        vals = vals.astype(np.float64)
    elif what == "length":
        idx = idx[:-1]
    elif what == "float_indices":
        idx = idx.astype(np.float64)
    elif what == "int_values":
        vals = vals.astype(np.int32)
    elif what == "two_d":
        vals = vals.reshape(2, 2, 5)  # (2-D values are rows)
    elif what == "n_beyond_int64":
        n = 2**63
    elif what == "not_an_array":
        vals = None
    elif what == "list_beyond_int64":
        idx = [*idx.tolist()[:-1], 2**63]
    return vals, idx, n


CASES = {
    # what: (error type, text expected in the message, needs P > 1)
    "out_of_range": (ValueError, "out of range", False),
    "negative": (ValueError, "out of range", False),
    "n": (ValueError, "n must be the same", True),
    "dtype": (TypeError, "dtype must be the same", True),
    "length": (ValueError, "differ in length", False),
    "float_indices": (TypeError, "indices must be integers", False),
    "int_values": (TypeError, "values must be float", False),
    "two_d": (ValueError, "1-D", False),
    "n_beyond_int64": (ValueError, "n must be below 2**63", False),
    # (were a ValueError "values must be 1-D, got shape ()" and a TypeError "indices must be
    # integers, got float64": numpy wraps None in a 0-d array, takes [.., 2**63] as floats)
    "not_an_array": (TypeError, "values must be an array, got NoneType", False),
    "list_beyond_int64": (ValueError, "index 9223372036854775808 out of range", False),
}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("what", sorted(CASES))
def test_bad_input_raises_everywhere(comm, name, what):
    etype, text, multi = CASES[what]
    if multi and comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    bad = comm.size - 1
    cls = algorithm_class(name)
    vals, idx = _good(comm.rank)
    n = N
    if comm.rank == bad:
        vals, idx, n = _spoil(what, vals, idx, n)
    try:
        sparsecoll.allreduce(comm, vals, idx, n=n, algorithm=name, **cls.default_options(N, 20))
        got = None
    except Exception as exc:  # every rank must land here with the same error
        got = (exc, str(exc))
    ok = (
        got is not None
        and isinstance(got[0], etype)
        and isinstance(got[0], sparsecoll.SparseCollError)
    )
    assert_all(comm, ok, f"expected {etype.__name__}, got {got!r}")
    msgs = comm.allgather_object(got[1])
    assert_all(comm, len(set(msgs)) == 1, f"messages differ: {msgs}")
    assert_all(comm, text in got[1] and f"rank {bad}" in got[1], f"message: {got[1]!r}")
    # the communicator is still usable afterwards
    vals, idx = _good(comm.rank)
    out = sparsecoll.allreduce(comm, vals, idx, n=N, algorithm="allgather")
    assert_all(comm, out.n == N)


@pytest.mark.parametrize("instance", ["none", "rank 0", "the others"])
def test_mismatched_algorithm(comm, instance):
    """Both algorithms are named, given by name or as an instance (it said only 'rank 2
    differs from rank 0'); an instance's options are not named against a name's."""
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    vals, idx = _good(comm.rank)
    bad = comm.size - 1
    name = "dense" if comm.rank == bad else "allgather"
    given = name
    if (instance == "rank 0") == (comm.rank == 0) and instance != "none":
        given = sparsecoll.get_algorithm(name)
    want = (
        f"algorithm must be the same on every rank: rank {bad} has 'dense', rank 0 has 'allgather'"
    )
    with pytest.raises(sparsecoll.CollectiveInputError, match=re.escape(want)):
        sparsecoll.allreduce(comm, vals, idx, n=N, algorithm=given)
    # the same algorithm, an instance with other options against a name: no option named
    given = sparsecoll.get_algorithm("gtopk", k=3) if comm.rank == 0 else "gtopk"
    options = {} if comm.rank == 0 else {"k": 4}
    with pytest.raises(sparsecoll.CollectiveInputError, match=r"algorithm options \(and the"):
        sparsecoll.allreduce(comm, vals, idx, n=N, algorithm=given, **options)


def _rows(rank: int, width: int | None):
    vals, idx = _good(rank)
    if width is None:
        return vals, idx
    return np.repeat(vals[:, None], width, axis=1) * np.arange(1, width + 1, dtype=vals.dtype), idx


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("mine", "theirs"), [(3, 2), (None, 3), (4, None)])
def test_mismatched_row_width(comm, name, mine, theirs):
    """Row values of another width (or 1-D against rows) on the last rank: the same error on
    every rank, naming both ranks' values shape; the communicator stays usable."""
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    bad = comm.size - 1
    cls = algorithm_class(name)
    # (an instance: a selecting one by name warns that its state starts anew at every call)
    algo = sparsecoll.get_algorithm(name, **cls.default_options(N, 20))
    vals, idx = _rows(comm.rank, theirs if comm.rank == bad else mine)
    if not cls.takes_rows and (mine or theirs):
        want = "takes 1-D values only"  # (refused before the shapes are compared)
    else:
        shape = {None: "(nnz,)", 2: "(nnz, 2)", 3: "(nnz, 3)", 4: "(nnz, 4)"}
        want = (
            f"values shape must be the same on every rank: rank {bad} has {shape[theirs]}, "
            f"rank 0 has {shape[mine]}"
        )
    try:
        sparsecoll.allreduce(comm, vals, idx, n=N, algorithm=algo)
        got = None
    except sparsecoll.CollectiveInputError as exc:
        got = str(exc)
    assert_all(comm, got is not None and want in got, f"message: {got!r}")
    msgs = comm.allgather_object(got)
    assert_all(comm, len(set(msgs)) == 1, f"messages differ: {msgs}")
    vals, idx = _rows(comm.rank, 3)
    out = sparsecoll.allreduce(comm, vals, idx, n=N, algorithm="allgather")
    assert_all(comm, out.width == 3 and out.n == N)


@pytest.mark.parametrize("name", [a for a in NAMES if not algorithm_class(a).takes_rows])
def test_selecting_algorithms_refuse_rows(comm, name):
    """Selecting algorithms (and any other without ``takes_rows``) keep 1-D values: rows on
    one rank raise there, and on every rank."""
    bad = comm.size - 1
    vals, idx = _rows(comm.rank, 3 if comm.rank == bad else None)
    if comm.size == 1:
        vals, idx = _rows(0, 3)
    algo = sparsecoll.get_algorithm(name, **algorithm_class(name).default_options(N, 20))
    with pytest.raises(sparsecoll.CollectiveInputError) as info:
        sparsecoll.allreduce(comm, vals, idx, n=N, algorithm=algo)
    text = str(info.value)
    assert_all(comm, f"algorithm {name!r} takes 1-D values only" in text, text)
    assert_all(comm, f"rank {bad}" in text or comm.size == 1, text)


# user algorithms of one __qualname__ ("Mine"), each on some rank: a class of this module;
# another defined in another module; one defined over the first under its name
_ALLGATHER = algorithm_class("allgather")
MINE = type("Mine", (_ALLGATHER,), {})
ALIKE = {
    "another module": type("Mine", (_ALLGATHER,), {"__module__": "elsewhere"}),
    "a subclass": type("Mine", (MINE,), {}),
}


@pytest.mark.parametrize("how", sorted(ALIKE))
@pytest.mark.parametrize("via", ["allreduce", "GradientReducer"])
def test_two_algorithms_of_one_qualname_are_told_apart(comm, monkeypatch, how, via):
    """Two classes named Mine, one on the last rank and the other elsewhere, are two
    algorithms: every rank raises the same CollectiveInputError naming the rank and both
    classes, through allreduce (an instance of each) and a GradientReducer (each rank's
    registry holding its own class under one name). They were compared by __qualname__
    alone: the call ran, each rank its own class's reduce()."""
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    bad = comm.size - 1
    cls = ALIKE[how] if comm.rank == bad else MINE
    ours = f"{MINE.__module__}.Mine"
    theirs = {"another module": "elsewhere.Mine", "a subclass": f"{ours} (a subclass of {ours})"}
    want = (
        f"algorithm class must be the same on every rank: rank {bad} has {theirs[how]!r}, "
        f"rank 0 has {ours!r}"
    )
    vals, idx = _good(comm.rank)
    try:
        if via == "allreduce":
            sparsecoll.allreduce(comm, vals, idx, n=N, algorithm=cls())
        else:
            from sparsecoll.registry import _REGISTRY

            monkeypatch.setitem(_REGISTRY, "test-mine", cls)
            red = sparsecoll.GradientReducer(comm, N, "test-mine", 0.02)
            red.step(np.ones(N))
        got = None
    except Exception as exc:  # every rank must land here with the same error
        got = (exc, str(exc))
    ok = got is not None and isinstance(got[0], sparsecoll.CollectiveInputError)
    assert_all(comm, ok, f"expected CollectiveInputError, got {got!r}")
    assert_all(comm, want in got[1], f"message: {got[1]!r}")
    assert_all(comm, len(set(comm.allgather_object(got[1]))) == 1, "messages differ")
    out = sparsecoll.allreduce(comm, vals, idx, n=N, algorithm=MINE())  # the ranks go on
    assert_all(comm, out.n == N)


DIFFERING_OPTIONS = {
    # (algorithm, its options on the other ranks, on the one rank): the message expected
    "gtopk_k": ("gtopk", {"k": 5}, {"k": 6}, "k must be the same on every rank: rank {r} has 6"),
    # (a default on the other ranks: named with its value)
    "oktopk_tau": (
        "oktopk",
        {"k": 5},
        {"k": 5, "tau": 8},
        "tau must be the same on every rank: rank {r} has 8, rank 0 has 32",
    ),
    "exdyna_rule": (
        "exdyna",
        {"k": 5},
        {"k": 5, "rule": "authors"},
        "rule must be the same on every rank: rank {r} has 'authors', rank 0 has 'window'",
    ),
}


@pytest.mark.parametrize("what", sorted(DIFFERING_OPTIONS))
@pytest.mark.parametrize("where", ["last", "middle"])
def test_an_option_differing_on_one_rank_is_named(comm, what, where):
    """allreduce(algorithm=name, **options) with an option one rank gives otherwise: the
    message names the option and both values, as a GradientReducer's does (it said
    'algorithm options (and the state of earlier calls) must be the same on every rank',
    naming neither the option nor a state, which a fresh instance has not)."""
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    name, common, odd, text = DIFFERING_OPTIONS[what]
    bad = comm.size - 1 if where == "last" else comm.size // 2
    vals, idx = _good(comm.rank)
    opts = odd if comm.rank == bad else common
    try:
        sparsecoll.allreduce(comm, vals, idx, n=N, algorithm=name, **opts)
        got = None
    except Exception as exc:
        got = (exc, str(exc))
    ok = got is not None and isinstance(got[0], sparsecoll.CollectiveInputError)
    assert_all(comm, ok, f"expected CollectiveInputError, got {got!r}")
    assert_all(comm, text.format(r=bad) in got[1], f"message: {got[1]!r}")


NEGATIVE_ZERO = {
    # (algorithm, its options on the even ranks, on the odd ranks)
    "auto_alpha": ("auto", {"alpha": 0.0}, {"alpha": -0.0}),
    "exdyna_tolerance": ("exdyna", {"k": 5, "tolerance": 0.0}, {"k": 5, "tolerance": -0.0}),
    "oktopk_band": ("oktopk", {"k": 5, "band": (0.0, 1.25)}, {"k": 5, "band": (-0.0, 1.25)}),
}


@pytest.mark.parametrize("what", sorted(NEGATIVE_ZERO))
@pytest.mark.parametrize("how", ["by name", "as an instance"])
def test_a_negative_zero_option_is_zero(comm, what, how):
    """-0.0 on the odd ranks where the others give 0.0 (a value computed as -x, say) is one
    option: the call runs, by name and as an instance (it raised 'alpha must be the same on
    every rank: rank 1 has -0.0, rank 0 has 0.0', or the options' unnamed mismatch for an
    instance, on every rank)."""
    name, even, odd = NEGATIVE_ZERO[what]
    options = odd if comm.rank % 2 else even
    vals, idx = _good(comm.rank)
    given = sparsecoll.get_algorithm(name, **options) if how == "as an instance" else name
    kw = {} if how == "as an instance" else options
    for _ in range(2):  # (the second call agrees on the first's state too)
        got = sparsecoll.allreduce(comm, vals, idx, n=N, algorithm=given, **kw)
    assert got.n == N


def test_unknown_algorithm_lists_known(comm):
    vals, idx = _good(comm.rank)
    with pytest.raises(sparsecoll.UnknownAlgorithmError, match="known: .*allgather"):
        sparsecoll.allreduce(comm, vals, idx, n=N, algorithm="no-such-thing")
    with pytest.raises(sparsecoll.UnknownAlgorithmError, match="did you mean 'oktopk'"):
        sparsecoll.allreduce(
            comm, vals, idx, n=N, algorithm="oktop" if comm.rank == 0 else "allgather"
        )


SELECTING = [a for a in NAMES if not algorithm_class(a).exact]


@pytest.mark.parametrize("name", SELECTING)
@pytest.mark.parametrize("how", ["given", "summed"])
def test_nan_on_one_rank_raises_everywhere_for_selecting(comm, name, how):
    """A NaN on one rank, given or made by coalescing (+inf and -inf at one index: the raw
    values hold no NaN), is the same error on every rank (gtopk's selection raised on that
    rank alone, the others hung; oktopk returned the NaN)."""
    vals, idx = _good(comm.rank)
    if comm.rank == comm.size - 1:
        if how == "given":
            vals[2] = np.nan
        else:
            vals[2], vals[3], idx[3] = np.inf, -np.inf, idx[2]
    cls = algorithm_class(name)
    for k in (1, 20):
        opts = {**cls.default_options(N, 20), "k": k}
        with pytest.raises(sparsecoll.CollectiveInputError, match=f"NaN.* on rank {comm.size - 1}"):
            sparsecoll.allreduce(comm, vals, idx, n=N, algorithm=name, **opts)


@pytest.mark.parametrize("name", ["oktopk", "exdyna"])
@pytest.mark.parametrize("how", ["n", "stream"])
def test_an_instance_used_for_other_calls_on_one_rank_raises_everywhere(comm, name, how):
    """Two instances with the same options and call count, used for other calls (another n,
    or the same n with a stream 100x larger): the last rank passing the other one is an
    error on every rank (exdyna raised on that rank alone and oktopk reset there alone: the
    others hung; with the same n, oktopk's ranks went on with different thresholds)."""
    if comm.size == 1:
        pytest.skip("needs two ranks")
    n_b, scale_b = (2 * N, 1.0) if how == "n" else (N, 100.0)
    a, b = (sparsecoll.get_algorithm(name, k=20) for _ in range(2))
    vals, idx = _good(comm.rank)
    for _ in range(3):
        sparsecoll.allreduce(comm, vals, idx, n=N, algorithm=a)
        sparsecoll.allreduce(comm, vals * np.float32(scale_b), idx, n=n_b, algorithm=b)
    mine = b if comm.rank == comm.size - 1 else a
    with pytest.raises(
        sparsecoll.CollectiveInputError, match=f"state of earlier calls.*rank {comm.size - 1}"
    ):
        sparsecoll.allreduce(comm, vals, idx, n=N, algorithm=mine)
    out = sparsecoll.allreduce(comm, vals, idx, n=N, algorithm=a)  # (a is still usable)
    assert_all(comm, out.nnz == 20 or name == "exdyna", f"kept {out.nnz}")


class _CustomSignature(sparsecoll.Algorithm):
    """An exact algorithm whose signature is given: on one rank, one that cannot be agreed
    (beyond int64, too long, not integers)."""

    name = "custom-signature"

    def __init__(self, values: list) -> None:
        self.values = values

    def signature(self) -> list:
        return list(self.values)

    def reduce(self, comm, x):
        return algorithm_class("allgather")().reduce(comm, x)


def _lone_option(what: str, rank: int, bad: int):
    """(algorithm, options) for ``rank``: ``bad`` gets the spoiled one."""
    spoil = rank == bad
    if what == "unknown_name":
        return ("no-such-thing" if spoil else "allgather"), {}
    if what in SIGNATURES:
        return _CustomSignature(SIGNATURES[what] if spoil else [1]), {}
    name, option = what.split(":")
    opts = dict(algorithm_class(name).default_options(N, 20))
    if spoil:
        opts[option] = 2**70
    return name, opts


# a custom algorithm's signature() on the spoiled rank (the others': [1]); too long or not
# integers, it raised (or int() truncated 1.5 to 1) on that rank alone, before the agreement
SIGNATURES = {
    "custom_signature": [2**64],
    "signature_too_long": [1] * 6,
    "signature_float": [1.5],
    "signature_none": [None],
}

LONE = {
    # what: (error type, text expected in the message)
    "unknown_name": (sparsecoll.UnknownAlgorithmError, "unknown algorithm 'no-such-thing'"),
    "custom_signature": (ValueError, "does not fit in int64"),
    "signature_too_long": (ValueError, "signature() has at most 5 values, got 6"),
    "signature_float": (TypeError, "an algorithm option must be an integer in the signature"),
    "signature_none": (TypeError, "got NoneType"),
    "gtopk:k": (ValueError, "k must be below 2**63"),
    "oktopk:k": (ValueError, "k must be below 2**63"),
    "exdyna:k": (ValueError, "k must be below 2**63"),
    # (were "an algorithm option does not fit in int64: ...", naming no option)
    "oktopk:tau": (ValueError, "tau must be below 2**63, got 1180591620717411303424"),
    "oktopk:tau_prime": (ValueError, "tau_prime must be below 2**63"),
    "exdyna:blocks": (ValueError, "blocks must be below 2**63"),
}


@pytest.mark.parametrize("what", sorted(LONE))
def test_bad_option_on_one_rank_raises_everywhere(comm, what):
    """An option or algorithm only one rank gets wrong, including integers beyond int64
    (agreed across ranks as int64: a lone OverflowError would leave the others waiting)."""
    etype, text = LONE[what]
    bad = comm.size - 1
    algorithm, opts = _lone_option(what, comm.rank, bad)
    vals, idx = _good(comm.rank)
    try:
        sparsecoll.allreduce(comm, vals, idx, n=N, algorithm=algorithm, **opts)
        got = None
    except Exception as exc:
        got = (exc, str(exc))
    ok = got is not None and isinstance(got[0], etype)
    ok = ok and isinstance(got[0], sparsecoll.SparseCollError)
    assert_all(comm, ok, f"expected {etype.__name__}, got {got!r}")
    msgs = comm.allgather_object(got[1])
    assert_all(comm, len(set(msgs)) == 1, f"messages differ: {msgs}")
    assert_all(comm, text in got[1] and f"rank {bad}" in got[1], f"message: {got[1]!r}")
    out = sparsecoll.allreduce(comm, vals, idx, n=N, algorithm="allgather")
    assert_all(comm, out.n == N)


class _Unviewable:
    """An array-like whose conversion fails with neither TypeError nor ValueError."""

    def __array__(self, dtype=None, copy=None):
        raise RuntimeError("this buffer is gone")


def _unviewable(what: str):
    if what == "array_raises":
        return _Unviewable()
    import torch

    if what == "torch_meta":
        return torch.ones(20, device="meta")
    if what == "torch_neg_view":
        return torch.ones(20)._neg_view()
    return torch.ones(20, dtype=torch.bfloat16)


def _type_error_everywhere(comm, call) -> str:
    """Run ``call`` on every rank; it must raise CollectiveTypeError with the same message
    on every rank, which is returned."""
    try:
        call()
        got = None
    except Exception as exc:
        got = (exc, str(exc))
    ok = got is not None and isinstance(got[0], sparsecoll.CollectiveTypeError)
    assert_all(comm, ok, f"expected CollectiveTypeError, got {got!r}")
    msgs = comm.allgather_object(got[1])
    assert_all(comm, len(set(msgs)) == 1, f"messages differ: {msgs}")
    return got[1]


@pytest.mark.parametrize("what", ["array_raises", "torch_meta", "torch_neg_view", "torch_bf16"])
def test_unviewable_values_on_one_rank_raise_everywhere(comm, what):
    """Whatever the conversion to an array raises on one rank (a BufferError for a torch
    meta tensor, a RuntimeError for a negative view) becomes the same TypeError on every
    rank, instead of a lone exception that leaves the others waiting."""
    if what.startswith("torch"):
        pytest.importorskip("torch")  # (on every rank: a skip on one alone leaves a hang)
    bad = comm.size - 1
    vals, idx = _good(comm.rank)
    spoiled = _unviewable(what) if comm.rank == bad else vals
    msg = _type_error_everywhere(
        comm, lambda: sparsecoll.allreduce(comm, spoiled, idx, n=N, algorithm="allgather")
    )
    assert_all(comm, msg.startswith("values") and f"rank {bad}" in msg, msg)
    out = sparsecoll.allreduce(comm, vals, idx, n=N, algorithm="allgather")
    assert_all(comm, out.n == N)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("which", ["values", "indices"])
def test_masked_entries_on_one_rank_raise_everywhere(comm, name, which):
    """A masked array with masked entries: numpy's conversion drops the mask, so the hidden
    entries were summed (exact algorithms) or the ranks parted ways (gtopk hung). Refused
    on every rank; one without masked entries is taken as its data."""
    bad = comm.size - 1
    cls = algorithm_class(name)
    opts = cls.default_options(N, 20)
    vals, idx = _good(comm.rank)
    v, i = vals, idx
    if comm.rank == bad:
        mask = np.arange(20) % 4 == 0
        if which == "values":
            v = np.ma.masked_array(vals, mask=mask)
        else:
            i = np.ma.masked_array(idx, mask=mask)
    msg = _type_error_everywhere(
        comm, lambda: sparsecoll.allreduce(comm, v, i, n=N, algorithm=name, **opts)
    )
    want = f"{which}: a masked array with 5 of 20 entries masked"
    assert_all(comm, msg.startswith(want) and f"rank {bad}" in msg, msg)
    unmasked = np.ma.masked_array(vals, mask=np.zeros(20, bool))
    out = sparsecoll.allreduce(comm, unmasked, idx, n=N, algorithm=name, **opts)
    ref = sparsecoll.allreduce(comm, vals, idx, n=N, algorithm=name, **opts)
    same = np.array_equal(out.indices, ref.indices) and np.array_equal(out.values, ref.values)
    assert_all(comm, same and type(out.values) is np.ndarray, "unmasked masked array")


def test_unexpected_local_error_on_one_rank_raises_everywhere(comm):
    """An error before the first collective that is not about the input (here an
    algorithm's ``signature()`` and a reducer's preparation raising OverflowError on one
    rank) is a CollectiveRuntimeError on every rank naming it, the original chained on that
    rank; it used to be raised there alone while the others waited in the collective."""
    bad = comm.size - 1
    base = algorithm_class("allgather")

    class Flaky(base):
        def signature(self) -> list[int]:
            if comm.rank == bad:
                raise OverflowError("math range error")
            return super().signature()

    text = f"OverflowError: math range error on rank {bad}"
    with pytest.raises(sparsecoll.CollectiveRuntimeError, match=text) as info:
        sparsecoll.allreduce(comm, np.ones(2, np.float32), [0, 1], n=4, algorithm=Flaky())
    assert_all(comm, comm.rank != bad or isinstance(info.value.__cause__, OverflowError))
    red = sparsecoll.GradientReducer(comm, 8, "allgather", 0.5)
    if comm.rank == bad:
        red._prepare = lambda *a: 1 / 0
    with pytest.raises(
        sparsecoll.CollectiveRuntimeError, match=f"ZeroDivisionError: .* on rank {bad}"
    ):
        red.step(np.ones(8))
    assert_all(comm, red.steps == 0, "failed step counted")
    out = sparsecoll.allreduce(comm, np.ones(2, np.float32), [0, 1], n=4)  # the ranks go on
    assert_all(comm, out.values.tolist() == [comm.size] * 2)


class _PluginInputError(sparsecoll.CollectiveInputError):
    """A user's algorithm's own error type (a subclass of one of sparsecoll's)."""


class _PluginError(sparsecoll.SparseCollError):
    """Another, under sparsecoll's base class alone."""


class _Unprintable(Exception):
    """An error whose message cannot be had (its ``__str__`` raises)."""

    def __str__(self):
        raise RuntimeError("no message")


@pytest.mark.parametrize(
    ("error", "etype", "text"),
    [
        (_PluginInputError("bad k"), sparsecoll.CollectiveInputError, "_PluginInputError: bad k"),
        (_PluginError("broken"), sparsecoll.SparseCollError, "_PluginError: broken"),
        (sparsecoll.NonFiniteError("NaN"), sparsecoll.NonFiniteError, "NaN"),
        # (str() raised on the offending rank before it sent the verdict: the others hung)
        (
            _Unprintable(),
            sparsecoll.CollectiveRuntimeError,
            "_Unprintable: <its message could not be read: str() raised RuntimeError>",
        ),
    ],
)
def test_a_user_algorithms_subclass_of_a_sparsecoll_error_raises_everywhere(
    comm, error, etype, text
):
    """A user's algorithm raising its own subclass of a sparsecoll error on one rank (in its
    preflight, before the ranks agree): every rank raises the nearest sparsecoll class,
    naming the subclass, the message and the rank. The other ranks looked the subclass up
    in sparsecoll.errors by name, and every rank raised AttributeError "module
    'sparsecoll.errors' has no attribute '_PluginInputError'", message and rank lost. An
    error whose message cannot be read is named by its class (the others hung)."""
    bad = comm.size - 1

    class Picky(algorithm_class("allgather")):
        def preflight(self, x):
            if comm.rank == bad:
                raise error

    with pytest.raises(etype, match=re.escape(f"{text} on rank {bad}")) as info:
        sparsecoll.allreduce(comm, np.ones(2, np.float32), [0, 1], n=4, algorithm=Picky())
    assert_all(comm, comm.rank != bad or info.value.__cause__ is error)
    out = sparsecoll.allreduce(comm, np.ones(2, np.float32), [0, 1], n=4)  # the ranks go on
    assert_all(comm, out.values.tolist() == [comm.size] * 2)


@pytest.mark.parametrize("values", [[1, 2, 3, 4, "rank"], [1] * 6, "raises"])
def test_a_reducer_agrees_on_the_whole_signature(comm, monkeypatch, values):
    """A GradientReducer compares every value of its algorithm's signature, as allreduce
    does: it used to compare the first 4 and drop the rest (a 5th value differing on one
    rank went unseen), and a signature() too long or raising failed on that rank alone."""
    from sparsecoll.registry import _REGISTRY

    bad = comm.size - 1
    fifth = "rank" in values
    if fifth and comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    if fifth:
        mine = [1, 2, 3, 4, 5 + (comm.rank == bad)]
    elif values == "raises":
        mine = None
    else:
        mine = values if comm.rank == bad else [1]

    class Signed(algorithm_class("allgather")):
        name = "test-signed"

        def signature(self) -> list[int]:
            if mine is None and comm.rank == bad:
                raise OverflowError("math range error")
            return list(mine or [1])

    monkeypatch.setitem(_REGISTRY, "test-signed", Signed)
    red = sparsecoll.GradientReducer(comm, 8, "test-signed", 0.5)
    if fifth:
        etype, text = sparsecoll.CollectiveInputError, "must be the same on every rank"
    elif mine is None:
        etype, text = sparsecoll.CollectiveRuntimeError, "OverflowError: math range error"
    else:
        etype, text = sparsecoll.CollectiveInputError, "signature() has at most 5 values, got 6"
    with pytest.raises(etype, match=f"{re.escape(text)}.*rank {bad}"):
        red.step(np.ones(8))
    assert_all(comm, red.steps == 0, "failed step counted")


# a reducer argument set after construction: (attribute, the value one rank sets, as named)
SET_ON_ONE_RANK = {
    "warmup": (3, "3", "0"),
    "average": (False, "False", "True"),
    "error_feedback": (False, "False", "True"),
    "momentum": (0.5, "0.5", "0.0"),
}


@pytest.mark.parametrize("name", sorted(SET_ON_ONE_RANK))
def test_a_reducer_argument_set_on_one_rank_raises_everywhere(comm, name):
    """warmup, average, error_feedback and momentum are agreed at every step, and so they
    are when set after construction: set on one rank, the next step raises the same
    CollectiveInputError on every rank naming it and both values, changing nothing; set
    alike on every rank, the steps go on with it. Before, the agreement held the values the
    reducer was built with: a warmup set on one rank made it reduce densely while the others
    ran the algorithm (the job hung: scratch p_warm.py at P=2, killed by timeout 60), and
    average or error_feedback made the ranks' updates differ silently (950 against 1900)."""
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    value, theirs, ours = SET_ON_ONE_RANK[name]
    bad = comm.size - 1
    n = 40
    red = sparsecoll.GradientReducer(comm, n, "allgather", 0.1)
    grad = np.arange(n, dtype=np.float64) + comm.rank
    first = red.step(grad).copy()
    if comm.rank == bad:
        setattr(red, name, value)
    text = f"{name} must be the same on every rank: rank {bad} has {theirs}, rank 0 has {ours}"
    with pytest.raises(sparsecoll.CollectiveInputError, match=re.escape(text)):
        red.step(grad)
    assert_all(comm, red.steps == 1, f"failed step counted: {red.steps}")
    setattr(red, name, value)  # (now on every rank)
    update = red.step(grad)
    assert_all(comm, getattr(red, name) == value, f"{name} is {getattr(red, name)!r}")
    same = comm.allgather_object(update.tolist())
    assert_all(comm, all(u == same[0] for u in same), "updates differ between the ranks")
    if name == "warmup":  # (step 1 < 3: dense again, step 0's residual sent with it)
        dense = np.count_nonzero(update) == n and not red.residual.any()
        assert_all(comm, dense, f"not a dense step: {update}")
    assert_all(comm, first.any(), "step 0 sent nothing")


@pytest.mark.parametrize("where", ["coalesce", "dense", "rabenseifner"])
def test_memory_running_out_on_one_rank_raises_everywhere(comm, monkeypatch, where):
    """Memory running out on one rank in the call's local work (coalescing the input, or a
    densifying algorithm's buffer of n values) is a CollectiveRuntimeError on every rank
    naming it: that work is done before the ranks agree on their input (it used to come
    after: that rank raised MemoryError alone, the others waited in the exchange)."""
    bad = comm.size - 1
    algorithm = "allgather" if where == "coalesce" else where

    def out_of_memory(*args):
        raise MemoryError("out of memory")

    if comm.rank == bad:
        owner = sparsecoll.api if where == "coalesce" else sparsecoll.SparseVector
        monkeypatch.setattr(owner, "coalesce" if where == "coalesce" else "to_dense", out_of_memory)
    values, indices = np.ones(3, np.float32), [0, 2, 0]
    with pytest.raises(sparsecoll.CollectiveRuntimeError, match=f"out of memory on rank {bad}"):
        sparsecoll.allreduce(comm, values, indices, n=5, algorithm=algorithm)
    monkeypatch.undo()
    out = sparsecoll.allreduce(comm, values, indices, n=5, algorithm=algorithm)
    assert_all(comm, out.values.tolist() == [2 * comm.size, comm.size], "the ranks go on")


def test_memory_running_out_on_one_rank_in_a_reducer_step(comm, monkeypatch):
    """The same in GradientReducer.step: a densifying algorithm's buffer of n values is made
    before the ranks agree (it was made in the exchange: that rank raised MemoryError alone,
    the others waited). The failed step changes nothing, and the next one goes on."""
    bad = comm.size - 1
    red = sparsecoll.GradientReducer(comm, 6, "rabenseifner", 0.5)
    grad = np.arange(6, dtype=np.float32)

    def out_of_memory(*args):
        raise MemoryError("out of memory")

    if comm.rank == bad:
        monkeypatch.setattr(sparsecoll.SparseVector, "to_dense", out_of_memory)
    with pytest.raises(sparsecoll.CollectiveRuntimeError, match=f"out of memory on rank {bad}"):
        red.step(grad)
    monkeypatch.undo()
    assert_all(comm, red.steps == 0, "a failed step counted")
    update = red.step(grad)
    assert_all(comm, update.tolist() == [0, 0, 0, 3, 4, 5], f"the ranks go on: {update}")


def test_memory_running_out_on_one_rank_when_auto_picks_dense(comm, monkeypatch):
    """auto picks its algorithm after the call's agreement (from the agreed total nnz); when
    it picks dense, dense's buffer of n values is made, and agreed on, before the exchange:
    memory running out on one rank is then a CollectiveRuntimeError on every rank naming it,
    in an allreduce and in a reducer step (that rank raised MemoryError alone, the others
    waited in the dense allreduce). The failed calls change nothing: the ranks go on."""
    bad, n = comm.size - 1, 64
    # merging made costly: auto picks dense wherever it may (P > 1); P = 1 runs allgather
    auto = sparsecoll.get_algorithm("auto", gamma_merge=1.0)
    red = sparsecoll.GradientReducer(comm, n, "auto", 1.0, gamma_merge=1.0)
    values, indices = np.ones(n, np.float32), np.arange(n)
    grad = np.arange(1, n + 1, dtype=np.float32)

    def out_of_memory(*args):
        raise MemoryError("out of memory")

    if comm.rank == bad:
        monkeypatch.setattr(sparsecoll.SparseVector, "to_dense", out_of_memory)
    if comm.size > 1:
        text = f"MemoryError: out of memory on rank {bad}"
        with pytest.raises(sparsecoll.CollectiveRuntimeError, match=text):
            sparsecoll.allreduce(comm, values, indices, n=n, algorithm=auto)
        with pytest.raises(sparsecoll.CollectiveRuntimeError, match=text):
            red.step(grad)
    monkeypatch.undo()
    out = sparsecoll.allreduce(comm, values, indices, n=n, algorithm=auto)
    choice = "dense" if comm.size > 1 else "allgather"
    assert_all(comm, out.info["auto_choice"] == choice, f"auto chose {out.info['auto_choice']}")
    assert_all(comm, out.values.tolist() == [comm.size] * n, "the ranks go on")
    assert_all(comm, red.steps == 0, "a failed step counted")
    full = red.stats()["full_topk_steps"]  # (the selection's state is given back too)
    assert_all(comm, full == 0, f"the failed step's top-k counted: {full}")
    update = red.step(grad)
    assert_all(comm, np.array_equal(update, grad), f"the reducer goes on: {update}")


@pytest.mark.parametrize("algorithm", ["dense", "warm-up"])
def test_memory_running_out_on_one_rank_for_a_dense_steps_update(comm, monkeypatch, algorithm):
    """A dense reducer step (the dense algorithm, or any algorithm's warm-up) given no
    ``out`` makes its update's n values before the ranks agree (they were made by the dense
    allreduce, after the agreement: that rank raised MemoryError alone, the others waited
    in the allreduce). The failed step changes nothing, and the next one goes on."""
    bad, n = comm.size - 1, 4099  # (an n that no other array of the step has)
    name, warmup = ("dense", 0) if algorithm == "dense" else ("allgather", 3)
    red = sparsecoll.GradientReducer(comm, n, name, 0.01, warmup=warmup)
    grad = np.arange(n, dtype=np.float32)
    red.step(grad)  # (the first step makes the reducer's own buffers)
    empty, empty_like = np.empty, np.empty_like

    def out_of_memory(make):
        def made(shape, *args, **kwargs):
            if np.prod(getattr(shape, "shape", shape)) == n:
                raise MemoryError("out of memory")
            return make(shape, *args, **kwargs)

        return made

    if comm.rank == bad:
        monkeypatch.setattr(np, "empty", out_of_memory(empty))
        monkeypatch.setattr(np, "empty_like", out_of_memory(empty_like))
    with pytest.raises(sparsecoll.CollectiveRuntimeError, match=f"out of memory on rank {bad}"):
        red.step(grad)
    monkeypatch.undo()
    assert_all(comm, red.steps == 1, "a failed step counted")
    update = red.step(grad)
    assert_all(comm, np.array_equal(update, grad), "the ranks go on")
    assert_all(comm, not red.residual.any(), "a dense step leaves no residual")


@pytest.mark.parametrize("hook_name", ["sparse_allreduce_hook", "async_sparse_allreduce_hook"])
def test_memory_running_out_on_one_rank_widening_a_bfloat16_bucket(comm, monkeypatch, hook_name):
    """The DDP hooks widen a bfloat16 bucket to float32 (numpy has none) before reducing it:
    memory running out there on one rank is a CollectiveRuntimeError on every rank naming
    it, in a dense warm-up iteration and in a sparse one (that rank raised MemoryError
    alone, the others waited in the dense allreduce or in the step's agreement). The failed
    iteration is taken back on every rank (the bucket that stepped before it gets its
    residual back), and the next iteration goes on."""
    torch = pytest.importorskip("torch")
    from sparsecoll.integrations import torch as sc_torch

    from ..test_torch_hook import _Bucket  # (a stand-in for torch's GradBucket)

    hook = getattr(sc_torch, hook_name)
    bad, sizes = comm.size - 1, (8, 16)  # the second bucket's widening fails on rank `bad`
    state = sc_torch.SparseHookState(comm, "allgather", density=0.25, warmup=1)
    params = [[torch.zeros(m)] for m in sizes]
    widen = torch.Tensor.float

    def out_of_memory(self, *args, **kwargs):
        if self.numel() == sizes[1]:
            raise MemoryError("out of memory")
        return widen(self, *args, **kwargs)

    def iteration() -> list[str]:
        """Both buckets through the hook (1..m in bfloat16): each one's value or error."""
        futures = []
        for i, m in enumerate(sizes):
            buf = torch.arange(1, m + 1, dtype=torch.bfloat16)
            futures.append(hook(state, _Bucket(i, len(sizes), buf, params[i])))
        got = []
        for f in futures:
            try:
                got.append(f.wait().float().tolist())
            except Exception as exc:
                got.append(f"{type(exc).__name__}: {exc}")
        return got

    if comm.rank == bad:
        monkeypatch.setattr(torch.Tensor, "float", out_of_memory)
    text = f"MemoryError: out of memory on rank {bad}"
    for what in ("dense warm-up", "sparse"):
        first, second = iteration()
        assert_all(comm, text in str(second), f"{what}: bucket 1 gave {second!r:.300}")
        assert_all(comm, isinstance(first, list), f"{what}: bucket 0 gave {first!r:.300}")
    monkeypatch.undo()
    red0, red1 = state.reducers[0], state.reducers[1]
    assert_all(comm, (red0.steps, red1.steps) == (1, 0), f"steps {red0.steps}, {red1.steps}")
    assert_all(comm, not red0.residual.any(), "the failed iteration's step was not taken back")
    first, second = iteration()
    # with nothing carried over, each bucket's update is its top quarter, 1..m
    assert_all(comm, first == [0.0] * 6 + [7.0, 8.0], f"the ranks go on: {first}")
    assert_all(comm, second == [0.0] * 12 + [13.0, 14.0, 15.0, 16.0], f"then: {second}")


def _widening_runs_out(n: int):
    """A maker of arrays that runs out of memory for float16's widening: a float32 array
    of ``n`` values (made by ``astype`` or by an allocation; nothing else in a float16 call
    is float32)."""

    def patched(make):
        def made(*args, **kwargs):
            got = make(*args, **kwargs)
            if got.dtype == np.float32 and got.size == n:
                raise MemoryError("out of memory")
            return got

        return made

    return patched


@pytest.mark.parametrize("caller", ["allreduce", "allreduce into out", "dense", "reducer"])
def test_memory_running_out_on_one_rank_widening_float16(comm, monkeypatch, caller):
    """float16 is summed in float32 (MPI has no portable half type): that float32 copy of n
    values is made before the ranks agree, in Communicator.allreduce (check=True) and by the
    callers that agree themselves (the dense algorithm, a reducer's dense step): memory
    running out there on one rank is a CollectiveRuntimeError on every rank naming it (it
    was made after the agreement: that rank raised MemoryError alone, the others waited in
    the allreduce). On the fake CuPy, whose allocations and casts a test can intercept
    (numpy's ``astype`` cannot be patched). The failed call changes nothing."""
    bad, n = comm.size - 1, 4099  # (an n that no other array of the call has)
    c = sparsecoll.Communicator(comm)
    with fakecupy.installed() as cp:
        grad = cp.asarray((np.arange(n) % 7).astype(np.float16))
        red = sparsecoll.GradientReducer(comm, n, "dense", 0.01)

        def call():
            if caller == "allreduce":
                return c.allreduce(grad)
            if caller == "allreduce into out":
                return c.allreduce(grad, out=cp.zeros(n, np.float16))
            if caller == "dense":
                indices = cp.asarray(np.arange(n))
                return sparsecoll.allreduce(comm, grad, indices, n=n, algorithm="dense")
            return red.step(grad)

        runs_out = _widening_runs_out(n)
        if comm.rank == bad:
            for name in ("empty", "empty_like", "zeros"):
                monkeypatch.setattr(cp, name, runs_out(getattr(cp, name)))
            monkeypatch.setattr(fakecupy.ndarray, "astype", runs_out(fakecupy.ndarray.astype))
        with pytest.raises(sparsecoll.CollectiveRuntimeError, match=f"out of memory on rank {bad}"):
            call()
        monkeypatch.undo()
        assert_all(comm, red.steps == 0, "a failed step counted")
        got = call()
        dense = got.to_dense() if caller == "dense" else got
        times = 1 if caller == "reducer" else comm.size  # (a reducer averages)
        want = (np.arange(n) % 7 * times).astype(np.float16)
        assert_all(comm, np.array_equal(dense.get(), want), f"the ranks go on: {dense[:5]}")


@pytest.mark.parametrize("hook_name", ["sparse_allreduce_hook", "async_sparse_allreduce_hook"])
def test_memory_running_out_on_one_rank_widening_a_float16_bucket(comm, monkeypatch, hook_name):
    """The DDP hooks' dense warm-up averages a float16 bucket in float32: that float32 copy
    is made before the warm-up's agreement, so memory running out there on one rank is a
    CollectiveRuntimeError on every rank naming it. (numpy's ``astype``, which made it after
    the agreement, cannot be intercepted: without the change this test fails by no rank
    raising; test_memory_running_out_on_one_rank_widening_float16 shows the hang.)"""
    torch = pytest.importorskip("torch")
    from sparsecoll.integrations import torch as sc_torch

    from ..test_torch_hook import _Bucket  # (a stand-in for torch's GradBucket)

    hook = getattr(sc_torch, hook_name)
    bad, n = comm.size - 1, 4099
    state = sc_torch.SparseHookState(comm, "allgather", density=0.25, warmup=2)
    params = [torch.zeros(n)]

    def bucket():
        buf = torch.arange(n, dtype=torch.float32).remainder(7).to(torch.float16)
        return _Bucket(0, 1, buf, params)

    if comm.rank == bad:
        monkeypatch.setattr(np, "empty", _widening_runs_out(n)(np.empty))
    # (torch's future wraps the hook's error in a RuntimeError naming it)
    with pytest.raises(Exception, match=f"MemoryError: out of memory on rank {bad}"):
        hook(state, bucket()).wait()
    monkeypatch.undo()
    got = hook(state, bucket()).wait()  # (the warm-up's average)
    want = torch.arange(n, dtype=torch.float32).remainder(7).to(torch.float16)
    assert_all(comm, torch.equal(got, want), f"the ranks go on: {got[:5]}")


def test_memory_running_out_on_one_rank_for_rabenseifners_scratch(comm, monkeypatch):
    """rabenseifner's scratch, where the received parts land (n values for a fold partner,
    n/2, n/4, ... for the others), is made in its preflight, before the ranks agree: memory
    running out there on one rank is a CollectiveRuntimeError on every rank naming it (it
    was made between the exchanges: that rank raised MemoryError alone, the others waited
    for it). On the fake CuPy, whose copies and allocations a test can intercept."""
    bad, n = comm.size - 1, 4099
    with fakecupy.installed() as cp:
        values = cp.asarray((np.arange(n) % 7).astype(np.float32))
        indices = cp.asarray(np.arange(n))

        def runs_out(make):
            def made(a, *args, **kwargs):
                if n // 4 <= a.size <= n:  # (the call's only such copies: its scratch)
                    raise MemoryError("out of memory")
                return make(a, *args, **kwargs)

            return made

        if comm.rank == bad:
            monkeypatch.setattr(cp, "empty_like", runs_out(cp.empty_like))
            copy = runs_out(lambda a, *args, **kwargs: a.__getattr__("copy")(*args, **kwargs))
            monkeypatch.setattr(fakecupy.ndarray, "copy", copy, raising=False)
        with pytest.raises(sparsecoll.CollectiveRuntimeError, match=f"out of memory on rank {bad}"):
            sparsecoll.allreduce(comm, values, indices, n=n, algorithm="rabenseifner")
        monkeypatch.undo()
        out = sparsecoll.allreduce(comm, values, indices, n=n, algorithm="rabenseifner")
        want = (np.arange(n) % 7 * comm.size).astype(np.float32)
        assert_all(comm, np.array_equal(out.to_dense().get(), want), "the ranks go on")


def test_memory_running_out_on_one_rank_for_recursive_doublings_dense_start(comm, monkeypatch):
    """recursive_doubling turns an input already past its switch point into n values
    before its first exchange: that is done in its preflight, before the ranks agree, so
    memory running out there on one rank is a CollectiveRuntimeError on every rank naming
    it (it was done after the agreement: that rank raised MemoryError alone, the others
    waited in the first exchange). A sparse input makes nothing there."""
    bad, n = comm.size - 1, 4099
    zeros = np.zeros

    def runs_out(shape, *args, **kwargs):
        if np.prod(shape) == n:  # (n or (n,))
            raise MemoryError("out of memory")
        return zeros(shape, *args, **kwargs)

    values = (np.arange(n) % 7 + 1).astype(np.float32)
    if comm.rank == bad:
        monkeypatch.setattr(np, "zeros", runs_out)
    with pytest.raises(sparsecoll.CollectiveRuntimeError, match=f"out of memory on rank {bad}"):
        sparsecoll.allreduce(comm, values, np.arange(n), n=n, algorithm="recursive_doubling")
    sparse = sparsecoll.allreduce(
        comm, values[:5], np.arange(5), n=n, algorithm="recursive_doubling"
    )
    monkeypatch.undo()
    assert_all(comm, sparse.values.tolist() == (values[:5] * comm.size).tolist(), "sparse input")
    out = sparsecoll.allreduce(comm, values, np.arange(n), n=n, algorithm="recursive_doubling")
    assert_all(comm, np.array_equal(out.to_dense(), values * comm.size), "the ranks go on")


@pytest.mark.parametrize("hook_name", ["sparse_allreduce_hook", "async_sparse_allreduce_hook"])
def test_hook_warmup_differing_across_ranks(comm, hook_name):
    """A DDP hook state built with a longer ``warmup`` on one rank: in the iteration where
    that rank still reduces densely and the others step their reducers, every rank raises
    the same error saying so, naming the rank. The warm-up's agreement carried no signature
    and the step's names differ from it: the ranks raised unlike errors ("n must be the
    same" on the stepping ranks, "algorithm options" on the other)."""
    torch = pytest.importorskip("torch")
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    from sparsecoll.integrations import torch as sc_torch

    from ..test_torch_hook import _Bucket  # (a stand-in for torch's GradBucket)

    hook = getattr(sc_torch, hook_name)
    bad = comm.size - 1
    warmup = 2 if comm.rank == bad else 1
    state = sc_torch.SparseHookState(comm, "allgather", density=0.25, warmup=warmup)
    params = [torch.zeros(8)]
    got = []
    for _ in range(2):  # iteration 0: a warm-up everywhere; 1: on rank `bad` only
        try:
            got.append(hook(state, _Bucket(0, 1, torch.arange(8.0), params)).wait().tolist())
        except Exception as exc:  # (torch adds the callback's traceback: the first line)
            got.append(str(exc).split("\n")[0])
    assert_all(comm, got[0] == [float(i) for i in range(8)], f"the warm-up gave {got[0]}")
    want = (
        "warmup (a rank in its dense warm-up while another steps), algorithm or options must"
        f" be the same on every rank: rank {bad} differs from rank 0"
    )
    texts = comm.allgather_object(got[1])
    assert_all(comm, isinstance(got[1], str) and want in got[1], f"{got[1]!r:.300}")
    assert_all(comm, all(t == texts[0] for t in texts), f"unlike errors: {texts}")


def _one_bucket(torch, hook, state, params):
    """One iteration of ``hook`` on a bucket of 0..7 (``params``): the reduced values, or
    the first line of the error it raised (torch adds the callback's traceback)."""
    from ..test_torch_hook import _Bucket  # (a stand-in for torch's GradBucket)

    try:
        return hook(state, _Bucket(0, 1, torch.arange(8.0), params)).wait().tolist()
    except Exception as exc:
        return str(exc).split("\n")[0]


@pytest.mark.parametrize("hook_name", ["sparse_allreduce_hook", "async_sparse_allreduce_hook"])
def test_hook_nonfinite_differing_across_ranks(comm, hook_name):
    """A DDP hook state built with another ``nonfinite`` on one rank: at the first sparse
    iteration every rank raises the same error naming the option and the rank. Before, it
    was agreed nowhere, and a NaN bucket raised on the "raise" ranks while the "nan" ranks
    went on with NaN gradients (scratch probe at P=2: rank 0 a NonFiniteError, rank 1 'nan
    grads'). Set alike on every rank between iterations, it is taken."""
    torch = pytest.importorskip("torch")
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    from sparsecoll.integrations import torch as sc_torch

    hook = getattr(sc_torch, hook_name)
    bad = comm.size - 1
    nonfinite = "nan" if comm.rank == bad else "raise"
    state = sc_torch.SparseHookState(comm, "allgather", density=0.25, nonfinite=nonfinite)
    params = [torch.zeros(8)]

    def iteration():
        return _one_bucket(torch, hook, state, params)

    assert_all(comm, iteration() == [float(i) for i in range(8)], "the warm-up")
    got = iteration()
    want = f"nonfinite must be the same on every rank: rank {bad} has 'nan', rank 0 has 'raise'"
    texts = comm.allgather_object(got)
    assert_all(comm, isinstance(got, str) and want in got, f"{got!r:.300}")
    assert_all(comm, all(t == texts[0] for t in texts), f"unlike errors: {texts}")
    state.nonfinite = "nan"  # (now alike: the bucket steps)
    assert_all(comm, isinstance(iteration(), list), "after nonfinite was set alike")
    with pytest.raises(ValueError, match="nonfinite must be 'raise' or 'nan', got 'skip'"):
        state.nonfinite = "skip"


@pytest.mark.parametrize("when", ["density_change", "restored_state"])
@pytest.mark.parametrize("hook_name", ["sparse_allreduce_hook", "async_sparse_allreduce_hook"])
def test_memory_running_out_on_one_rank_building_a_bucket_reducer(
    comm, monkeypatch, hook_name, when
):
    """A bucket's reducer is built (or rebuilt) when the bucket comes by: carried to a new
    ``state.density`` (a copy of its state) or from a restored state (a copy of the saved
    residual). Memory running out there on one rank is a CollectiveRuntimeError on every
    rank naming it: before, that rank raised MemoryError alone and the others waited in
    the step's agreement for ever (scratch probe15.py, both hooks, both cases, P=2: killed
    by timeout). That rank keeps what it had (the restored state is not dropped), so once
    memory is there again the next iteration steps on every rank alike."""
    torch = pytest.importorskip("torch")
    from sparsecoll.integrations import torch as sc_torch

    hook = getattr(sc_torch, hook_name)
    bad = comm.size - 1
    state = sc_torch.SparseHookState(comm, "allgather", density=0.25)
    params = [torch.zeros(8)]

    def iteration():
        return _one_bucket(torch, hook, state, params)

    for _ in range(2):  # the warm-up, then a sparse step (the residual holds 0..5)
        iteration()
    if when == "density_change":
        state.density = 0.5
        method = "state_dict"
    else:
        state.load_state_dict(state.state_dict())
        method = "load_state_local"
    if comm.rank == bad:

        def out_of_memory(*args):
            raise MemoryError("out of memory")

        monkeypatch.setattr(sparsecoll.GradientReducer, method, out_of_memory)
    got = iteration()
    want = f"MemoryError: out of memory on rank {bad}"
    assert_all(comm, isinstance(got, str) and want in got, f"{when}: {got!r:.300}")
    monkeypatch.undo()
    got = iteration()  # 0..7 plus the residual 0..5: the top 2 (or 4) of 0, 2, .., 10, 7
    top = [0.0] * 4 + [8.0, 10.0] if when == "restored_state" else [0.0] * 3 + [6.0, 8.0, 10.0]
    want = [*top, 0.0, 0.0] if when == "restored_state" else [*top, 0.0, 7.0]
    assert_all(comm, got == want, f"{when}, the ranks go on: {got!r:.300}")
    assert_all(comm, state.reducers[0].steps == 2, f"steps {state.reducers[0].steps}")


@pytest.fixture
def torch_world(comm):
    """torch.distributed (gloo) over MPI's world, destroyed after the test."""
    pytest.importorskip("torch")
    import torch.distributed as dist

    from sparsecoll.integrations import torch as sc_torch

    sc_torch.init_process_group(comm.mpi_comm)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def _raises_everywhere(comm, call, kind=sparsecoll.CollectiveInputError) -> str:
    """Run ``call`` on every rank: it must raise ``kind`` with the same message on every
    rank, which is returned."""
    try:
        call()
        got = None
    except Exception as exc:
        got = exc
    ok = isinstance(got, kind)
    assert_all(comm, ok, f"expected {kind.__name__}, got {got!r:.400}")
    msgs = comm.allgather_object(str(got))
    assert_all(comm, len(set(msgs)) == 1, f"messages differ: {msgs}")
    return msgs[0]


def test_a_hook_state_is_checked_against_ddps_process_group(comm, torch_world):
    """SparseHookState(process_group=...) checks, on every rank, that its communicator holds
    exactly DDP's group's processes in its order, and without a communicator builds one of
    them. Before, the state took no process group and reduced over its communicator alone:
    DDP on two halves of the ranks with a state on COMM_WORLD averaged over every rank,
    silently (scratch p_group.py at P=4: 2.5 on every rank where the halves' averages were
    1.5 and 3.5)."""
    import torch
    from mpi4py import MPI

    from sparsecoll.integrations import torch as sc_torch

    dist, world = torch_world, MPI.COMM_WORLD
    half = max(1, comm.size // 2)
    parts = [list(range(half)), list(range(half, comm.size))]
    groups = [dist.new_group(p) if p else None for p in parts]  # (on every rank)
    mine, members = (groups[0], parts[0]) if comm.rank < half else (groups[1], parts[1])

    # only the group: a communicator of its processes, and DDP averages over the group
    state = sc_torch.SparseHookState(process_group=mine, algorithm="allgather", density=1.0)
    got = state.comm.allgather_object(comm.rank)
    assert_all(comm, got == members, f"the state's communicator holds world ranks {got}")
    assert_all(comm, state.process_group is mine, "the state's process_group")
    model = torch.nn.Linear(1, 1, bias=False)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=mine)
    ddp.register_comm_hook(state, sc_torch.sparse_allreduce_hook)
    for _ in range(2):  # a dense warm-up iteration, then a sparse one
        model.zero_grad()
        (ddp(torch.ones(1, 1)) * (comm.rank + 1)).sum().backward()
        want = sum(members) / len(members) + 1
        grad = model.weight.grad.item()
        assert_all(comm, grad == want, f"gradient {grad}, the group's average is {want}")

    if comm.size == 1:  # (MPI's world is the group's, in its order)
        sc_torch.SparseHookState(world, process_group=dist.group.WORLD)
        return
    # the world's communicator for a half's group: refused on every rank
    msg = _raises_everywhere(comm, lambda: sc_torch.SparseHookState(world, process_group=mine))
    want = f"the hook's communicator has {comm.size} ranks but the process_group has {half}"
    assert_all(comm, msg.startswith(want) and msg.endswith("on rank 0"), msg)
    # the world's processes in another order than the default group's
    backwards = world.Split(0, comm.size - comm.rank)
    msg = _raises_everywhere(
        comm, lambda: sc_torch.SparseHookState(backwards, process_group=dist.group.WORLD)
    )
    want = f"this process is rank 0 of the hook's communicator but rank {comm.size - 1} of"
    assert_all(comm, msg.startswith(want), msg)
    backwards.Free()
    # a group this rank is not in (the second half's, on the first half)
    msg = _raises_everywhere(comm, lambda: sc_torch.SparseHookState(world, process_group=groups[1]))
    want = "process_group: this process (torch's global rank 0) is not in it"
    assert_all(comm, msg.startswith(want) and msg.endswith("on rank 0"), msg)
    msg = _raises_everywhere(
        comm,
        lambda: sc_torch.SparseHookState(world, process_group="world"),
        sparsecoll.CollectiveTypeError,
    )
    want = "process_group must be a torch.distributed process group, got a str on rank 0"
    assert_all(comm, msg == want, msg)
    # another argument bad on one rank: raised on every rank with the group's check
    density = [0.5] * (comm.size - 1) + [2.0]
    msg = _raises_everywhere(
        comm,
        lambda: sc_torch.SparseHookState(
            world, process_group=dist.group.WORLD, density=density[comm.rank]
        ),
    )
    assert_all(comm, "density" in msg and msg.endswith(f"on rank {comm.size - 1}"), msg)
    sc_torch.SparseHookState(world, process_group=dist.group.WORLD)  # (the default group)
