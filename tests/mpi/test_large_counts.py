"""Payloads past MPI-3's int counts (2**31 - 1 bytes) on MPI libraries without the MPI-4
large-count calls (Open MPI 5.0: mpi4py raised MPI_ERR_ARG there)."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from mpi4py import MPI

import sparsecoll
import sparsecoll.comm as scomm
from sparsecoll import Communicator

from .cases import assert_all

# What sparsecoll's payload calls meet on a library without MPI-4's large counts (Open MPI
# 5.0), at the lowered limit: a count or displacement past scomm.COUNT_MAX raises (there
# MPI_ERR_ARG: the int cannot hold it; a collective raises on every rank), and
# Status.Get_count past it gives MPI_UNDEFINED. Only payloads are checked: explicit counts
# and raw byte views (metadata is int64 and float64 arrays, and pickles sent by Bcast or
# Allgatherv, which this file's limits do not concern).
PAYLOAD_CALLS = {"Send", "Isend", "Recv", "Irecv", "Sendrecv", "Isendrecv", "Mprobe", "Improbe"}
COLLECTIVES = {"Allreduce", "Iallreduce", "Alltoallv", "Ialltoallv"}


def _counts(arg) -> list[int]:
    """The counts and displacements of one buffer argument of an mpi4py call."""
    if isinstance(arg, (list, tuple)) and len(arg) == 3:
        spec = arg[1]
        if isinstance(spec, int):
            return [spec]
        if isinstance(spec, tuple):
            return [int(v) for part in spec for v in part]
    if isinstance(arg, np.ndarray) and arg.dtype == np.uint8:
        return [arg.size]
    return []


class _IntCounts:
    """An mpi4py communicator (or message) whose payload calls reject counts past
    scomm.COUNT_MAX (unless ``large``); ``calls`` logs (name, largest count) of each
    payload call made."""

    def __init__(self, obj, calls: list, large: bool = False):
        self._obj = obj
        self.calls = calls
        self.large = large

    def __getattr__(self, name):
        attr = getattr(self._obj, name)
        if name not in PAYLOAD_CALLS | COLLECTIVES:
            return attr

        def call(*args, **kwargs):
            counts = [c for a in args for c in _counts(a)]
            if counts:
                self.calls.append((name, max(counts)))
            over = not self.large and max(counts, default=0) > scomm.COUNT_MAX
            if name in COLLECTIVES:  # every rank raises, as a collective's argument check did
                over = self._obj.allreduce(over, op=MPI.LOR)
            if over:
                raise MPI.Exception(MPI.ERR_ARG)
            result = attr(*args, **kwargs)
            if isinstance(result, MPI.Message):
                return _IntCounts(result, self.calls, self.large)
            return result

        return call


class _IntStatus(MPI.Status):
    def Get_count(self, datatype=MPI.BYTE):
        count = super().Get_count(datatype)
        return MPI.UNDEFINED if count > scomm.COUNT_MAX else count


class _IntMPI:
    """mpi4py.MPI with the Status above."""

    Status = _IntStatus

    def __getattr__(self, name):
        return getattr(MPI, name)


@pytest.fixture
def int_counts(monkeypatch):
    """``make(comm, limit, poll)``: a Communicator on ``comm``'s MPI communicator as a
    library without large counts serves it, the limit lowered to ``limit`` (``large``: a
    library with them, MPICH 4); its ``calls`` attribute logs the payload calls."""

    def make(comm, limit, poll=False, large=False):
        monkeypatch.setattr(scomm, "COUNT_MAX", limit)
        monkeypatch.setattr(scomm, "_large_counts", lambda: large)
        if not large:
            monkeypatch.setattr(scomm, "_mpi", _IntMPI)
        c = Communicator(comm.mpi_comm, poll=poll)
        c.mpi_comm = _IntCounts(comm.mpi_comm, [], large)
        c.calls = c.mpi_comm.calls
        return c

    return make


def _part(rank: int) -> np.ndarray:
    """Rank r's part: 3r + 1 floats, rank 1's empty (a zero count among the others)."""
    length = 0 if rank == 1 else 3 * rank + 1
    return np.arange(length, dtype=np.float32) + 100 * rank


@pytest.mark.parametrize("poll", [False, True])
def test_allgatherv_past_the_count_limit(comm, monkeypatch, poll):
    """The limit lowered to 5 bytes: every part goes by broadcasts, in pieces."""
    monkeypatch.setattr(scomm, "COUNT_MAX", 5)
    monkeypatch.setattr(scomm, "_large_counts", lambda: False)
    c = Communicator(comm.mpi_comm, poll=poll)
    out, counts = c.allgatherv(_part(c.rank))
    want = np.concatenate([_part(r) for r in range(c.size)])
    assert_all(comm, counts == [len(_part(r)) for r in range(c.size)], f"counts {counts}")
    assert_all(comm, np.array_equal(out, want), f"gathered {out.tolist()}")
    others = (want.shape[0] - len(_part(c.rank))) * 4
    assert_all(comm, c.stats.bytes_recv == others, f"recv {c.stats.bytes_recv} != {others}")


def test_allgather_algorithm_past_the_count_limit(comm, monkeypatch):
    rng = np.random.default_rng([3, comm.rank])
    idx = rng.integers(0, 500, 40)
    vals = rng.standard_normal(40).astype(np.float32)
    want = sparsecoll.allreduce(comm, vals, idx, n=500, algorithm="allgather")
    monkeypatch.setattr(scomm, "COUNT_MAX", 7)
    monkeypatch.setattr(scomm, "_large_counts", lambda: False)
    got = sparsecoll.allreduce(comm, vals, idx, n=500, algorithm="allgather")
    assert_all(comm, np.array_equal(got.indices, want.indices), "indices differ")
    assert_all(comm, np.array_equal(got.values, want.values), "values differ")


@pytest.mark.parametrize("poll", [False, True])
def test_point_to_point_past_the_count_limit(comm, monkeypatch, poll):
    """The limit lowered to 12 bytes: rank 0's 8 bytes go plain, the others' messages as
    one element of a derived type; a ring of sendrecv, then of isend/irecv."""
    monkeypatch.setattr(scomm, "COUNT_MAX", 12)
    monkeypatch.setattr(scomm, "_large_counts", lambda: False)
    c = Communicator(comm.mpi_comm, poll=poll)
    dest, src = (c.rank + 1) % c.size, (c.rank - 1) % c.size

    def part(r):
        return np.arange(3 * r + 2, dtype=np.float32) + 100 * r

    got = np.empty_like(part(src))
    c.sendrecv(part(c.rank), dest, got, src, tag=3)
    ok = np.array_equal(got, part(src))
    got2 = np.empty_like(got)
    recv = c.irecv(got2, src, tag=4)
    send = c.isend(part(c.rank), dest, tag=4)
    scomm.Request.waitall([recv, send])
    ok = ok and np.array_equal(got2, part(src))
    assert_all(comm, ok, f"from {src}: {got.tolist()} {got2.tolist()}")


def _same_past_the_limit(comm, name: str, seed: int, lowered) -> None:
    """Algorithm ``name`` returns the same on the Communicator ``lowered()`` returns (the
    limit lowered) as on ``comm``."""
    rng = np.random.default_rng([seed, comm.rank])
    idx = rng.integers(0, 300, 60)
    vals = rng.standard_normal(60).astype(np.float32)
    opts = {"k": 30} if name in ("gtopk", "exdyna") else {}
    want = sparsecoll.allreduce(comm, vals, idx, n=300, algorithm=name, **opts)
    got = sparsecoll.allreduce(lowered(), vals, idx, n=300, algorithm=name, **opts)
    assert_all(comm, np.array_equal(got.indices, want.indices), "indices differ")
    assert_all(comm, np.array_equal(got.values, want.values), "values differ")


@pytest.mark.parametrize("name", ["rabenseifner", "recursive_doubling", "dsa", "gtopk"])
def test_point_to_point_algorithms_past_the_count_limit(comm, monkeypatch, name):
    def lowered():
        monkeypatch.setattr(scomm, "COUNT_MAX", 9)
        monkeypatch.setattr(scomm, "_large_counts", lambda: False)
        return comm

    _same_past_the_limit(comm, name, 5, lowered)


def _dense(rank: int, dtype) -> np.ndarray:
    """Rank r's 13 values: small integers, so every sum (and float16's) is exact."""
    return (np.arange(13) * (rank + 1) + rank).astype(dtype)


@pytest.mark.parametrize("poll", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("out", [None, "buf", "other"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_allreduce_past_the_count_limit(comm, int_counts, poll, dtype, out, op):
    """The limit lowered to 4 elements: 13 go as 4 allreduces (4, 4, 4, 1), in place when
    the call is, and count as the one allreduce they replace."""
    c = int_counts(comm, 4, poll)
    buf = _dense(c.rank, dtype)
    dest = {None: None, "buf": buf, "other": np.full(13, -1, dtype)}[out]
    got = c.allreduce(buf, out=dest, op=op)
    work = np.float32 if dtype == np.float16 else dtype
    want = sum(_dense(r, work) for r in range(c.size))
    want = (want / c.size if op == "mean" else want).astype(dtype)
    ok = np.array_equal(got, want) and (dest is None or got is dest)
    assert_all(comm, ok, f"{got.tolist()} != {want.tolist()}")
    chunks = [n for name, n in c.calls if name.endswith("llreduce")]
    want_chunks = [4, 4, 4, 1] if c.size > 1 else []
    assert_all(comm, chunks == want_chunks, f"allreduce calls of {chunks} elements")
    moved = 2 * (c.size - 1) * 13 * np.dtype(work).itemsize // c.size
    msgs = 2 * math.ceil(math.log2(c.size))
    sent = (c.stats.bytes_sent, c.stats.messages_sent)
    assert_all(comm, sent == (moved, msgs), f"sent {sent}, an allreduce sends {(moved, msgs)}")


def test_allreduce_split_only_without_large_counts(comm, int_counts):
    """A library with the large-count calls (MPICH 4) gets the one allreduce."""
    c = int_counts(comm, 4, large=True)
    got = c.allreduce(_dense(c.rank, np.float32))
    want = sum(_dense(r, np.float32) for r in range(c.size))
    chunks = [n for name, n in c.calls if name == "Allreduce"]
    ok = np.array_equal(got, want) and chunks == ([13] if c.size > 1 else [])
    assert_all(comm, ok, f"allreduce calls of {chunks} elements")


@pytest.mark.parametrize("name", ["dense", "exdyna"])
def test_dense_allreduce_algorithms_past_the_count_limit(comm, int_counts, name):
    """dense sums all n = 300 values, exdyna its k = 30 selected ones: in chunks of 7."""
    _same_past_the_limit(comm, name, 7, lambda: int_counts(comm, 7))


def test_gradient_reducer_warmup_past_the_count_limit(comm, int_counts):
    """The warm-up steps are dense allreduces of the whole gradient."""
    grads = [np.random.default_rng([9, comm.rank, s]).standard_normal(50) for s in range(2)]
    grads = [g.astype(np.float32) for g in grads]
    plain = sparsecoll.GradientReducer(comm, 50, "allgather", 0.2, warmup=2)
    want = [plain.step(g.copy()).copy() for g in grads]
    c = int_counts(comm, 16)
    red = sparsecoll.GradientReducer(c, 50, "allgather", 0.2, warmup=2)
    got = [red.step(g.copy()) for g in grads]
    ok = all(np.array_equal(a, b) for a, b in zip(got, want))
    assert_all(comm, ok, "warm-up steps differ")


def _sendcounts(rank: int, size: int) -> list[int]:
    """What rank r sends to each rank: (r + 2j) % 5 float32 (some zero, some to itself)."""
    return [(rank + 2 * j) % 5 for j in range(size)]


def _chunk(src: int, dst: int, count: int) -> np.ndarray:
    return np.arange(count, dtype=np.float32) + 100 * src + 10 * dst


@pytest.mark.parametrize("poll", [False, True])
@pytest.mark.parametrize("limit", [10, 4])
def test_alltoallv_past_the_count_limit(comm, int_counts, poll, limit):
    """The limit lowered to 10 bytes (some ranks' counts or displacements pass it, the
    others' not: all of them go point to point), then 4 (every message does)."""
    c = int_counts(comm, limit, poll)
    P, me = c.size, c.rank
    counts = _sendcounts(me, P)
    send = np.concatenate([_chunk(me, j, n) for j, n in enumerate(counts)])
    got, recvcounts = c.alltoallv(send, counts)
    want_counts = [_sendcounts(r, P)[me] for r in range(P)]
    want = np.concatenate([_chunk(r, me, n) for r, n in enumerate(want_counts)])
    ok = recvcounts == want_counts and np.array_equal(got, want)
    assert_all(comm, ok, f"got {got.tolist()} {recvcounts}")
    sb = [4 * n for n in counts]
    rb = [4 * n for n in want_counts]
    want_stats = (
        sum(sb) - sb[me],
        sum(rb) - rb[me],
        sum(1 for j, n in enumerate(sb) if n and j != me),
        sum(1 for j, n in enumerate(rb) if n and j != me),
    )
    s = c.stats
    stats = (s.bytes_sent, s.bytes_recv, s.messages_sent, s.messages_recv)
    assert_all(comm, stats == want_stats, f"stats {stats} != {want_stats}")


def test_alltoallv_within_the_count_limit(comm, int_counts):
    """Nothing past the limit on any rank: the one Alltoallv."""
    c = int_counts(comm, 4 * 5 * 8)
    counts = _sendcounts(c.rank, c.size)
    send = np.concatenate([_chunk(c.rank, j, n) for j, n in enumerate(counts)])
    c.alltoallv(send, counts)
    names = {name for name, _ in c.calls}
    assert_all(comm, names == {"Alltoallv"}, f"payload calls {names}")


@pytest.mark.parametrize("poll", [False, True])
def test_recv_bytes_past_the_count_limit(comm, int_counts, poll):
    """The limit lowered to 12 bytes: a ring where rank 0's 8 bytes arrive plain, the others'
    past the limit (MPI_Get_count cannot say how many: Get_elements does)."""
    c = int_counts(comm, 12, poll)
    dest, src = (c.rank + 1) % c.size, (c.rank - 1) % c.size

    def part(r):
        return (np.arange(3 * r + 2, dtype=np.float32) + 100 * r).view(np.uint8)

    send = c.isend(part(c.rank), dest, tag=6)
    try:  # (a receive that raises fails every rank, none left waiting in the assertion)
        got = c.recv_bytes(src, tag=6)
    except Exception as exc:
        got = exc
    send.wait()
    ok = isinstance(got, np.ndarray) and np.array_equal(got, part(src))
    ok = ok and c.stats.bytes_recv == (got.size if c.size > 1 else 0)
    assert_all(comm, ok, f"from {src}: {got!r}")


BIG = pytest.mark.skipif(
    os.environ.get("SPARSECOLL_BIG") != "1", reason="set SPARSECOLL_BIG=1 (about 8 GiB)"
)


@BIG
def test_sendrecv_of_more_than_2_gib(comm):
    """For real: 2**31 + 64 bytes each way (Open MPI 5.0 raised MPI_ERR_ARG)."""
    if comm.size != 2:
        pytest.skip("one P is enough (memory)")
    part = np.full((2**31 + 64) // 4, comm.rank + 1, dtype=np.float32)
    part[-1] = 7 + comm.rank
    got = np.zeros_like(part)
    comm.sendrecv(part, 1 - comm.rank, got, 1 - comm.rank)
    other = 2 - comm.rank
    ok = got[0] == other and got[-2] == other and got[-1] == 6 + other
    assert_all(comm, ok, f"got {got[0]} {got[-2]} {got[-1]}")


@BIG
def test_allgatherv_of_more_than_2_gib(comm):
    """For real: rank 0's part is 2**31 + 64 bytes, so its count and rank 1's displacement
    pass the limit (Open MPI 5.0 raised MPI_ERR_ARG on every rank)."""
    if comm.size != 2:
        pytest.skip("one P is enough (memory)")
    n = (2**31 + 64) // 4 if comm.rank == 0 else 3
    part = np.full(n, comm.rank + 1, dtype=np.float32)
    part[-1] = 7 + comm.rank
    out, counts = comm.allgatherv(part)
    del part
    a = counts[0]
    ok = (
        counts == [(2**31 + 64) // 4, 3]
        and out[0] == 1
        and out[a - 2] == 1
        and out[a - 1] == 7
        and out[a : a + 2].tolist() == [2, 2]
        and out[-1] == 8
    )
    assert_all(comm, ok, f"counts {counts}")
