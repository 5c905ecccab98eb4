"""wire="compact": allgather, dsa, recursive_doubling, ring and hashed give the bits of
wire="raw", the exact sum, and send fewer bytes where the pairs are sparse."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given

import sparsecoll
from sparsecoll.benchmarks.problems import make_problem

from .cases import KINDS, assert_all, assert_identical, cases, digest, local_input, mismatch

WIRED = ("allgather", "dsa", "recursive_doubling", "ring", "hashed")


@pytest.mark.parametrize("name", WIRED)
@given(case=cases(kinds=(*KINDS, "cancel")))
def test_compact_is_raw_bit_for_bit(comm, name, case):
    vals, idx = local_input(case, comm.rank, comm.size)
    raw = sparsecoll.allreduce(comm, vals, idx, n=case.n, algorithm=name)
    algo = sparsecoll.get_algorithm(name, wire="compact")
    got = sparsecoll.allreduce(comm, vals, idx, n=case.n, algorithm=algo)
    why = mismatch(got, case, comm.size)
    assert_all(comm, why is None, str(why))
    assert_all(comm, digest(got) == digest(raw), f"{name}: compact differs from raw ({case})")
    assert_identical(comm, got)
    shared = np.shares_memory(got.values, vals) or np.shares_memory(got.indices, idx)
    assert_all(comm, not shared, f"{name}: the compact result shares memory with the input")


@pytest.mark.parametrize("name", WIRED)
def test_compact_result_owns_its_memory_when_one_rank_has_pairs(comm, name):
    """Sorted unique input (coalescing keeps its arrays) on one rank, none elsewhere: the
    result, that rank's pairs, is a copy."""
    n = 1000
    idx = np.arange(3, 900, 7, dtype=np.int32) if comm.rank == 0 else np.zeros(0, np.int32)
    vals = np.linspace(1, 2, idx.size, dtype=np.float32)
    algo = sparsecoll.get_algorithm(name, wire="compact")
    out = sparsecoll.allreduce(comm, vals, idx, n=n, algorithm=algo)
    ok = np.array_equal(out.indices, np.arange(3, 900, 7)) and np.array_equal(
        out.values, np.linspace(1, 2, 129, dtype=np.float32)
    )
    assert_all(comm, ok, f"{name}: wrong result")
    shared = np.shares_memory(out.values, vals) or np.shares_memory(out.indices, idx)
    assert_all(comm, not shared, f"{name}: the result shares memory with the input")


@pytest.mark.parametrize("name", WIRED)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_compact_sends_fewer_bytes_at_one_percent(comm, name, dtype):
    n = 2_000_000
    vals, idx = make_problem(n, 0.01, comm.rank, comm.size, "random", dtype, seed=9)
    sent = {}
    for wire in ("raw", "compact"):
        algo = sparsecoll.get_algorithm(name, wire=wire)
        with comm.measure() as stats:
            out = sparsecoll.allreduce(comm, vals, idx, n=n, algorithm=algo)
        sent[wire] = stats.bytes_sent
        assert_identical(comm, out)
    if comm.size == 1:
        return
    pair = 8 if dtype == "float32" else 12
    bound = 5.0 if dtype == "float32" else 8.6  # bytes a pair
    if name == "hashed":  # (its raw runs are already bitmaps where denser: count its pairs)
        per_pair = sent["compact"] / _hashed_pairs_sent(comm, idx, out, n)
        assert_all(comm, per_pair <= bound, f"hashed: {per_pair:.2f} bytes a pair > {bound}")
        assert_all(comm, sent["compact"] < sent["raw"], f"hashed: {sent}")
        return
    ratio = sent["compact"] / sent["raw"]
    bound /= pair
    assert_all(comm, ratio <= bound, f"{name}: compact/raw bytes {ratio:.3f} > {bound:.3f}")


@pytest.mark.parametrize(
    ("overlap", "dtype", "width"),
    [("random", "float32", None), ("skewed", "float64", None), ("same", "float32", 2)],
)
def test_compact_pieces_are_raw_bit_for_bit(comm, overlap, dtype, width):
    """Runs long enough to travel in several pieces (recursive_doubling's compact sums),
    and a sum that goes dense on the way (n = 400K: each rank's 120K pairs, unions past
    the dense switch)."""
    for n, density in ((4_000_000, 0.025), (400_000, 0.3)):
        vals, idx = make_problem(n, density, comm.rank, comm.size, overlap, dtype, seed=3)
        if width:
            vals = np.stack([vals, -2 * vals], axis=1)
        want = sparsecoll.allreduce(comm, vals, idx, n=n, algorithm="dense")
        raw = sparsecoll.allreduce(comm, vals, idx, n=n, algorithm="recursive_doubling")
        algo = sparsecoll.get_algorithm("recursive_doubling", wire="compact")
        got = sparsecoll.allreduce(comm, vals, idx, n=n, algorithm=algo)
        assert_all(comm, digest(got) == digest(raw), f"{overlap} n={n}: compact differs from raw")
        dense = np.zeros((n, *vals.shape[1:]), vals.dtype)
        dense[np.asarray(got.indices)] = got.values
        ref = np.zeros_like(dense)
        ref[np.asarray(want.indices)] = want.values
        err = float(np.max(np.abs(dense - ref), initial=0.0))
        assert_all(comm, err <= 1e-5 * comm.size, f"{overlap} n={n}: off the dense sum by {err}")
        assert_identical(comm, got)


def _hashed_pairs_sent(comm, idx, out, n):
    """The pairs hashed's rank sends: its entries of other owners, then in each Bruck round
    the owners' reduced runs it forwards."""
    from sparsecoll.algorithms._stripes import Stripes
    from sparsecoll.algorithms.dsa import bruck_counts
    from sparsecoll.algorithms.hashed import BLOCK_SHIFT

    P, r = comm.size, comm.rank
    stripes = Stripes(n, P, BLOCK_SHIFT, 0)
    push = int(np.count_nonzero(stripes.locate(np.asarray(idx))[0] != r))
    runs = np.bincount(stripes.locate(out.indices)[0], minlength=P)
    pull = sum(int(runs[(r + b) % P]) for cnt in bruck_counts(P) for b in range(cnt))
    return push + pull


def test_option_is_checked_and_agreed(comm):
    with pytest.raises(ValueError, match="wire must be one of raw, compact"):
        sparsecoll.get_algorithm("dsa", wire="zip")
    algo = sparsecoll.get_algorithm("allgather", wire="compact")
    with pytest.raises(AttributeError, match="fixed at construction"):
        algo.wire = "raw"
    if comm.size == 1:
        return
    # ranks that disagree on the wire fail together, rather than misread each other's bytes
    wire = "compact" if comm.rank == 0 else "raw"
    vals = np.ones(3, np.float32)
    idx = np.arange(3, dtype=np.int32)
    with pytest.raises(sparsecoll.errors.SparseCollError):
        sparsecoll.allreduce(comm, vals, idx, n=10, algorithm="dsa", wire=wire)


@pytest.mark.parametrize("name", WIRED)
def test_received_messages_decoded_where_they_land(comm, name, monkeypatch):
    """Every message of IN_PLACE bytes or more that a rank receives is read where it landed
    (8-aligned, room after it), not copied first; allgather's last rank's message, at the
    end of the receive buffer, excepted."""
    from sparsecoll.wire import _format

    n = 1 << 20
    vals, idx = make_problem(n, 0.05, comm.rank, comm.size, "random", "float32", seed=4)
    looks, beyond = [], _format._beyond

    def spy(buf, start, nbytes, align):
        out = beyond(buf, start, nbytes, align)
        if align:  # (a decode's look, not padded()'s)
            looks.append(out is not None)
        return out

    monkeypatch.setattr(_format, "_beyond", spy)
    algo = sparsecoll.get_algorithm(name, wire="compact")
    sparsecoll.allreduce(comm, vals, idx, n=n, algorithm=algo)
    allowed = 1 if name == "allgather" and comm.rank != comm.size - 1 else 0
    copied = looks.count(False)
    assert_all(comm, copied <= allowed, f"{name}: {copied} of {len(looks)} messages copied")
    if comm.size > 1:  # (every rank decodes some: the check above is not empty)
        assert_all(comm, len(looks) >= 1, f"{name}: no message of IN_PLACE bytes decoded")
