"""Byte accounting: what each algorithm moves per rank, asserted exactly."""

from __future__ import annotations

import numpy as np
import pytest

import sparsecoll
from sparsecoll.algorithms.base import Fold

from .cases import assert_all


def _input(rank: int, n: int, k: int, dtype=np.float32):
    rng = np.random.default_rng([7, rank])
    idx = np.sort(rng.choice(n, size=k + rank, replace=False))  # different nnz per rank
    return rng.standard_normal(idx.shape[0]).astype(dtype), idx


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("n", [1000, 2**31 + 10])
def test_allgather_receives_others_pairs(comm, dtype, n):
    vals, idx = _input(comm.rank, n, 50, dtype)
    out = sparsecoll.allreduce(comm, vals, idx, n=n, algorithm="allgather")
    st = out.info["stats"]
    pair = (4 if n <= 2**31 else 8) + np.dtype(dtype).itemsize
    nnz = [50 + r for r in range(comm.size)]
    others = (sum(nnz) - nnz[comm.rank]) * pair
    assert_all(comm, st.bytes_recv == others, f"recv {st.bytes_recv} != {others}")
    assert_all(comm, st.bytes_sent == others, f"sent {st.bytes_sent} != {others}")
    assert_all(comm, comm.last_stats == st)


@pytest.mark.parametrize("name", ["rabenseifner", "dense"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dense_references_send_2_p_minus_1_over_p_n(comm, name, dtype):
    P = comm.size
    n = 840 * 16  # divisible by every power of two up to 8 and by 3, 5
    vals, idx = _input(comm.rank, n, 100, dtype)
    out = sparsecoll.allreduce(comm, vals, idx, n=n, algorithm=name)
    item = np.dtype(dtype).itemsize
    fold = Fold.plan(comm.rank, P)
    p = fold.pof2
    if name == "dense" or P == 1:
        want = 2 * (P - 1) * n * item // P
    elif fold.folded:
        want = n * item  # hands its vector over, gets the result back
    else:
        want = 2 * (p - 1) * n * item // p + (n * item if fold.partner >= 0 else 0)
    got = out.info["stats"].bytes_sent
    assert_all(comm, got == want, f"{name} sent {got}, expected {want}")
    if P & (P - 1) == 0:  # power of two: the textbook 2(P-1)/P n
        assert_all(comm, got == 2 * (P - 1) * n * item // P)


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_dense_allreduce_float16_in_a_given_work_buffer(comm, op):
    """float16 summed in a float32 ``work`` array made ahead (as the callers that agree
    before their allreduce make it): the same bits as a float16 allreduce without it (the
    float32 sum, and mean, rounded once to float16), the same bytes moved; a ``work`` that
    does not fit is refused."""
    c = sparsecoll.Communicator(comm)
    P, n = comm.size, 1000
    rng = np.random.default_rng(comm.rank)
    # multiples of 1/16 below 128: their float32 sums are exact in any order, so that the
    # rounding to float16 (and the mean's division) is all that rounds
    mine = (rng.integers(-2048, 2048, n) / 16).astype(np.float16)
    total = np.array(comm.allgather_object(mine)).astype(np.float32).sum(axis=0)
    want = (total / np.float32(P) if op == "mean" else total).astype(np.float16)
    moved = 2 * (P - 1) * n * 4 // P
    plain = c.allreduce(mine, op=op)
    work = np.full(n, np.nan, np.float32)
    with c.measure() as st:
        got = c.allreduce(mine, op=op, work=work)
    buf = mine.copy()
    c.allreduce(buf, out=buf, op=op, work=np.empty(n, np.float32))
    for what, a in (("without work", plain), ("with work", got), ("in place", buf)):
        same = a.dtype == np.float16 and np.array_equal(a.view(np.uint16), want.view(np.uint16))
        assert_all(comm, same, f"{what}: {a[:5]}, want {want[:5]}")
    assert_all(comm, st.bytes_sent == moved, f"with work: {st.bytes_sent} bytes, not {moved}")
    for bad_buf, bad in (
        (mine, np.empty(n, np.float64)),
        (mine, np.empty(n + 1, np.float32)),
        (mine, np.empty(2 * n, np.float32)[::2]),
        (mine.astype(np.float32), np.empty(n, np.float32)),  # (float16 only)
    ):
        with pytest.raises(ValueError, match="work must be a contiguous float32"):
            c.allreduce(bad_buf, work=bad)


@pytest.mark.parametrize("poll", [False, True], ids=["blocking", "polling"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_dense_allreduce_into_out_and_in_place(comm, dtype, poll):
    """``Communicator.allreduce``: a new array, into ``out``, or in place (``out=buf``,
    MPI_IN_PLACE); the same sum and the same bytes every way; a bad ``out`` raises."""
    c = sparsecoll.Communicator(comm, poll=poll)
    P, n = comm.size, 1000
    # small integers: every sum is exact in every dtype, whatever the order
    mine = lambda: ((np.arange(n) * (comm.rank + 1)) % 7).astype(dtype)  # noqa: E731
    want = sum(((np.arange(n) * (r + 1)) % 7) for r in range(P)).astype(dtype)
    moved = 2 * (P - 1) * n * np.dtype(np.float32 if dtype == np.float16 else dtype).itemsize // P

    buf = mine()
    with c.measure() as st:
        got = c.allreduce(buf)
    ok = got is not buf and got.dtype == dtype and (got == want).all() and (buf == mine()).all()
    assert_all(comm, ok and st.bytes_sent == moved, f"new array: {got[:5]}, {st.bytes_sent}")

    buf, out = mine(), np.full(n, -1, dtype)
    with c.measure() as st:
        got = c.allreduce(buf, out=out)
    ok = got is out and (out == want).all() and (buf == mine()).all()
    assert_all(comm, ok and st.bytes_sent == moved, f"into out: {got[:5]}, {st.bytes_sent}")

    buf = mine()
    with c.measure() as st:
        got = c.allreduce(buf, out=buf)
    ok = got is buf and (buf == want).all()
    assert_all(comm, ok and st.bytes_sent == moved, f"in place: {got[:5]}, {st.bytes_sent}")

    for bad in (np.zeros(n + 1, dtype), np.zeros(n, np.int64), np.zeros(2 * n, dtype)[::2]):
        with pytest.raises(ValueError, match="out must be a contiguous"):
            c.allreduce(mine(), out=bad)
    for bad in ("avg", "max"):
        with pytest.raises(ValueError, match="op must be 'sum' or 'mean'"):
            c.allreduce(mine(), op=bad)
    for bad in (np.int32, np.int64, bool):  # at every size (MPI has no float16 either)
        with pytest.raises(TypeError, match="float16, float32 or float64 arrays, got"):
            c.allreduce(mine().astype(bad))

    # out another view of buf's memory (e.g. two .numpy() views of one tensor): in place;
    # partly overlapping buf: the sum of buf as it was (MPI forbids aliased buffers: MPICH
    # raised "Invalid buffer pointer", or aborted the job on the overlap)
    buf = mine()
    with c.measure() as st:
        got = c.allreduce(buf, out=buf.view())
    ok = np.shares_memory(got, buf) and (buf == want).all()
    assert_all(comm, ok and st.bytes_sent == moved, f"same memory: {got[:5]}, {st.bytes_sent}")
    base = np.zeros(n + 3, dtype)
    base[:n] = mine()
    got = c.allreduce(base[:n], out=base[3:])
    ok = got.base is base and (base[3:] == want).all()
    assert_all(comm, ok, f"overlapping out: {got[:5]}")


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_dense_allreduce_mean(comm, dtype):
    """``op="mean"``: the sum divided by P in the precision it was summed in, the same into
    ``out``, in place or new. float16 sums in float32, so an average that fits in float16
    does not overflow when the sum (60000 P) does."""
    c = sparsecoll.Communicator(comm)
    P, n = comm.size, 100
    mine = np.full(n, 60000 if dtype == np.float16 else 3, dtype)
    mine[1] = comm.rank + 1
    wide = np.float32 if dtype == np.float16 else dtype
    want = mine.astype(wide) * P
    want[1] = P * (P + 1) // 2
    want = (want / P).astype(dtype) if P > 1 else want.astype(dtype)
    for how in ("new", "out", "in place"):
        buf = mine.copy()
        out = None if how == "new" else buf if how == "in place" else np.empty_like(buf)
        got = c.allreduce(buf, out=out, op="mean")
        ok = got.dtype == dtype and np.array_equal(got, want) and (out is None or got is out)
        assert_all(comm, ok, f"{how}: {got[:3]}, want {want[:3]}")


@pytest.mark.parametrize("what", ["dtype", "size", "op", "big_endian", "bad_out", "list"])
def test_dense_allreduce_agrees_on_its_arguments(comm, what):
    """One rank's float64 among float32 (the same bytes: MPI summed float32 bits against
    float64 ones, a different garbage on each rank), another size or op, or a bad ``out``
    on one rank only (it raised alone; the others waited in MPI_Allreduce): the same error
    on every rank, naming it. A big-endian or list buffer on one rank is summed as native."""
    if comm.size == 1 and what in ("dtype", "size", "op"):
        pytest.skip("needs two ranks to disagree")
    c = sparsecoll.Communicator(comm)
    bad = comm.size - 1
    buf, out, op = np.ones(4, np.float32), None, "sum"
    if comm.rank == bad:
        if what == "dtype":
            buf = np.ones(2, np.float64)
        elif what == "size":
            buf = np.ones(5, np.float32)
        elif what == "op":
            op = "mean"
        elif what == "big_endian":
            buf = np.ones(4, ">f4")
        elif what == "bad_out":
            out = np.zeros(4, np.float64)
        else:
            buf = [1.0] * 4
            if comm.size > 1:
                buf = np.array(buf, np.float32)  # (alone, a list gives float64: no mismatch)
    expect = {
        "dtype": (sparsecoll.CollectiveTypeError, "buf dtype must be the same on every rank"),
        "size": (sparsecoll.CollectiveInputError, "buf size must be the same on every rank"),
        "op": (sparsecoll.CollectiveInputError, "op must be the same on every rank"),
        "bad_out": (sparsecoll.CollectiveInputError, "out must be a contiguous"),
    }
    if what in ("big_endian", "list"):
        got = c.allreduce(buf, out=out, op=op)
        want = 1.0 if op == "mean" else comm.size
        assert_all(comm, np.array_equal(got, np.full(4, want)), f"{what}: {got}")
        return
    etype, text = expect[what]
    try:
        c.allreduce(buf, out=out, op=op)
        got = None
    except Exception as exc:
        got = exc
    ok = isinstance(got, etype) and text in str(got)
    ok = ok and (f"rank {bad}" in str(got) if what == "bad_out" else True)
    assert_all(comm, ok, f"{what}: {got!r}")
    msgs = comm.allgather_object(str(got))
    assert_all(comm, len(set(msgs)) == 1, f"messages differ: {msgs}")
    assert_all(comm, np.array_equal(c.allreduce(np.ones(3)), np.full(3, comm.size)))
