"""Bad input on one rank: every rank raises the same error naming that rank, and no hang."""

from __future__ import annotations

import numpy as np
import pytest

import sparsecoll
from sparsecoll.registry import algorithm_class

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
        vals = vals.reshape(4, 5)
    elif what == "n_beyond_int64":
        n = 2**63
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


def test_mismatched_algorithm(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    vals, idx = _good(comm.rank)
    name = "allgather" if comm.rank == 0 else "dense"
    with pytest.raises(sparsecoll.CollectiveInputError, match="algorithm must be the same"):
        sparsecoll.allreduce(comm, vals, idx, n=N, algorithm=name)


def test_unknown_algorithm_lists_known(comm):
    vals, idx = _good(comm.rank)
    with pytest.raises(sparsecoll.UnknownAlgorithmError, match="known: .*allgather"):
        sparsecoll.allreduce(comm, vals, idx, n=N, algorithm="no-such-thing")


@pytest.mark.parametrize("name", [a for a in NAMES if not algorithm_class(a).exact])
def test_nan_on_one_rank_raises_everywhere_for_selecting(comm, name):
    vals, idx = _good(comm.rank)
    if comm.rank == comm.size - 1:
        vals[2] = np.nan
    cls = algorithm_class(name)
    with pytest.raises(sparsecoll.CollectiveInputError, match=f"NaN.* on rank {comm.size - 1}"):
        sparsecoll.allreduce(comm, vals, idx, n=N, algorithm=name, **cls.default_options(N, 20))


@pytest.mark.parametrize(
    ("name", "option"), [("gtopk", "k"), ("oktopk", "k"), ("oktopk", "tau"), ("exdyna", "blocks")]
)
def test_option_beyond_int64_on_one_rank_raises_everywhere(comm, name, option):
    """An option that cannot travel in the int64 option check (here on the last rank only)
    raises the same error on every rank instead of leaving the others in the check."""
    vals, idx = _good(comm.rank)
    opts = algorithm_class(name).default_options(N, 20)
    bad = comm.size - 1
    if comm.rank == bad:
        opts[option] = 2**63
    try:
        sparsecoll.allreduce(comm, vals, idx, n=N, algorithm=name, **opts)
        got = None
    except sparsecoll.CollectiveInputError as exc:
        got = str(exc)
    assert_all(comm, got is not None and f"rank {bad}" in got, f"got {got!r}")
    msgs = comm.allgather_object(got)
    assert_all(comm, len(set(msgs)) == 1, f"messages differ: {msgs}")
