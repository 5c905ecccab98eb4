"""Payloads past MPI-3's int counts (2**31 - 1 bytes) on MPI libraries without the MPI-4
large-count calls (Open MPI 5.0: mpi4py raised MPI_ERR_ARG there)."""

from __future__ import annotations

import math
import os
import sys
import time

import numpy as np
import pytest
from mpi4py import MPI

import sparsecoll
import sparsecoll._mpilib as mpilib
from sparsecoll import Communicator
from sparsecoll._polling import Request

from .. import fakecupy
from .cases import assert_all

# What sparsecoll's payload calls meet on a library without MPI-4's large counts (Open MPI
# 5.0), at the lowered limit: a count or displacement past mpilib.COUNT_MAX raises (there
# MPI_ERR_ARG: the int cannot hold it; a collective raises on every rank), and
# Status.Get_count past it gives MPI_UNDEFINED. Only payloads are checked: explicit counts
# and raw byte views, on the host or the device (metadata is int64 and float64 arrays;
# pickles go by Bcast or Allgatherv only on error paths, which this file does not take).
PAYLOAD_CALLS = {"Send", "Isend", "Recv", "Irecv", "Sendrecv", "Isendrecv", "Mprobe", "Improbe"}
COLLECTIVES = {"Allreduce", "Iallreduce", "Alltoallv", "Ialltoallv", "Allgatherv", "Iallgatherv"}
COLLECTIVES |= {"Bcast", "Ibcast"}  # (allgatherv's pieces past the limit)


def _byte_view(arg) -> bool:
    """Whether ``arg`` is a raw byte view: numpy, or device memory handed to CUDA-aware MPI."""
    array = isinstance(arg, np.ndarray) or hasattr(arg, "__cuda_array_interface__")
    return array and arg.dtype == np.uint8


def _counts(arg) -> list[int]:
    """The counts and displacements of one buffer argument of an mpi4py call."""
    if isinstance(arg, (list, tuple)) and len(arg) == 3:
        spec = arg[1]
        if isinstance(spec, int):
            return [spec]
        if isinstance(spec, tuple):
            return [int(v) for part in spec for v in part]
    if isinstance(arg, list) and len(arg) == 2 and _byte_view(arg[0]):  # [bytes, MPI.BYTE]
        return [int(arg[0].size)]
    if _byte_view(arg):
        return [int(arg.size)]
    return []


class _IntCounts:
    """An mpi4py communicator (or message) whose payload calls reject counts past
    mpilib.COUNT_MAX (unless ``large``); ``calls`` logs (name, largest count) of each
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
            over = not self.large and max(counts, default=0) > mpilib.COUNT_MAX
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
        return MPI.UNDEFINED if count > mpilib.COUNT_MAX else count


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
        monkeypatch.setattr(mpilib, "COUNT_MAX", limit)
        monkeypatch.setattr(mpilib, "large_counts", lambda: large)
        if not large:
            monkeypatch.setattr(mpilib, "mpi", _IntMPI)
        c = Communicator(comm.mpi_comm, poll=poll)
        c.mpi_comm = _IntCounts(comm.mpi_comm, [], large)
        c.calls = c.mpi_comm.calls
        return c

    return make


def _host(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()


def _problem(check, *args) -> str | None:
    """``check(*args)``'s problem, or what it raised: every rank goes on to the agreeing
    assertion (a rank that raised alone would otherwise leave the others waiting there)."""
    try:
        return check(*args)
    except Exception as exc:
        return f"{check.__name__} raised {exc!r}"


def _started(comm, posts) -> tuple[list, str | None]:
    """Start the calls ``posts`` (functions returning a Request; each tried on its own),
    then agree on every rank whether all of them started everywhere. If any raised (on
    any rank), this rank's started requests are cancelled and completed: nothing is left
    waiting for a message that a failed call never sent (nor matches a later test's).
    Returns ``(requests, problem)``."""
    reqs, problem = [], None
    for post in posts:
        try:
            reqs.append(post())
        except Exception as exc:
            problem = problem or f"raised {exc!r}"
    failed = [r for r, bad in enumerate(comm.allgather_object(problem is not None)) if bad]
    if failed:
        for req in reqs:
            req._req.Cancel()
        MPI.Request.Waitall([req._req for req in reqs])
        return [], problem or f"ranks {failed} failed to start theirs"
    return reqs, None


def _settled(comm, capsys, call, seconds: float = 60.0):
    """``call()``'s result, or what it raised; then every rank waits for the others (a
    nonblocking barrier, at most ``seconds``). A call that raised on one rank alone can
    leave another waiting inside the library for a message that never comes: then the job
    is aborted, this rank's outcome printed (past pytest's capture, ``capsys``), instead of
    hanging until the file's timeout."""
    try:
        result = call()
    except Exception as exc:
        result = exc
    req = comm.mpi_comm.Ibarrier()
    deadline = time.monotonic() + seconds
    while not req.Test():
        if time.monotonic() > deadline:
            with capsys.disabled():
                print(f"rank {comm.rank}: {result!r}; a rank is still waiting", file=sys.stderr)
                sys.stderr.flush()
                comm.abort(1)
        time.sleep(0.01)
    return result


def _part(rank: int) -> np.ndarray:
    """Rank r's part: 3r + 1 floats, rank 1's empty (a zero count among the others)."""
    length = 0 if rank == 1 else 3 * rank + 1
    return np.arange(length, dtype=np.float32) + 100 * rank


def _allgatherv_problem(c, xp) -> str | None:
    out, counts = c.allgatherv(xp.asarray(_part(c.rank)))
    want = np.concatenate([_part(r) for r in range(c.size)])
    others = (want.shape[0] - len(_part(c.rank))) * 4
    if counts != [len(_part(r)) for r in range(c.size)]:
        return f"counts {counts}"
    if not isinstance(out, xp.ndarray) or not np.array_equal(_host(out), want):
        return f"gathered {out!r}"
    if c.stats.bytes_recv != others:
        return f"recv {c.stats.bytes_recv} != {others}"
    return None


@pytest.mark.parametrize("poll", [False, True])
def test_allgatherv_past_the_count_limit(comm, int_counts, poll):
    """The limit lowered to 3 bytes (every nonempty part passes it): every part goes by
    broadcasts, in pieces."""
    c = int_counts(comm, 3, poll)
    why = _problem(_allgatherv_problem, c, np)
    assert_all(comm, why is None, why)


def _same_past_the_limit(comm, capsys, name: str, seed: int, lowered) -> None:
    """Algorithm ``name`` returns the same on the Communicator ``lowered()`` returns (the
    limit lowered) as on ``comm``."""
    rng = np.random.default_rng([seed, comm.rank])
    idx = rng.integers(0, 300, 60)
    vals = rng.standard_normal(60).astype(np.float32)
    opts = {"k": 30} if name in ("gtopk", "exdyna") else {}
    want = sparsecoll.allreduce(comm, vals, idx, n=300, algorithm=name, **opts)
    c = lowered()

    def call():
        return sparsecoll.allreduce(c, vals, idx, n=300, algorithm=name, **opts)

    got = _settled(comm, capsys, call)
    assert_all(comm, not isinstance(got, Exception), f"raised {got!r}")
    assert_all(comm, np.array_equal(got.indices, want.indices), "indices differ")
    assert_all(comm, np.array_equal(got.values, want.values), "values differ")


def test_allgather_algorithm_past_the_count_limit(comm, int_counts, capsys):
    _same_past_the_limit(comm, capsys, "allgather", 3, lambda: int_counts(comm, 7))


def _ring(r: int) -> np.ndarray:
    """What rank r sends round the ring: 3r + 2 floats (rank 0's 8 bytes stay within the
    point-to-point tests' limit of 12, the others' pass it)."""
    return np.arange(3 * r + 2, dtype=np.float32) + 100 * r


def _point_to_point_problem(comm, capsys, c, xp) -> str | None:
    """A ring of sendrecv, then of irecv/isend (started everywhere before any wait)."""
    dest, src = (c.rank + 1) % c.size, (c.rank - 1) % c.size
    mine = xp.asarray(_ring(c.rank))
    got = xp.zeros(len(_ring(src)), dtype=np.float32)
    done = _settled(comm, capsys, lambda: c.sendrecv(mine, dest, got, src, 3))
    problem = done and f"sendrecv raised {done!r}"
    got2 = xp.zeros_like(got)
    reqs, started = _started(comm, [lambda: c.irecv(got2, src, 4), lambda: c.isend(mine, dest, 4)])
    problem = problem or started or _problem(Request.waitall, reqs)
    if problem:
        return problem
    ok = all(
        isinstance(a, xp.ndarray) and np.array_equal(_host(a), _ring(src)) for a in (got, got2)
    )
    return None if ok else f"from {src}: {got!r} {got2!r}"


@pytest.mark.parametrize("poll", [False, True])
def test_point_to_point_past_the_count_limit(comm, int_counts, capsys, poll):
    """The limit lowered to 12 bytes: rank 0's 8 bytes go plain, the others' messages as
    one element of a derived type."""
    c = int_counts(comm, 12, poll)
    why = _point_to_point_problem(comm, capsys, c, np)
    assert_all(comm, why is None, why)


@pytest.mark.parametrize("name", ["rabenseifner", "recursive_doubling", "dsa", "gtopk"])
def test_point_to_point_algorithms_past_the_count_limit(comm, int_counts, capsys, name):
    _same_past_the_limit(comm, capsys, name, 5, lambda: int_counts(comm, 9))


def _dense(rank: int, dtype) -> np.ndarray:
    """Rank r's 13 values: small integers, so every sum (and float16's) is exact."""
    return (np.arange(13) * (rank + 1) + rank).astype(dtype)


def _allreduce_problem(c, xp, dtype, out, op) -> str | None:
    """13 values summed at the limit of 4 elements: 4 allreduces (4, 4, 4, 1), in place
    when the call is, counted as the one allreduce they replace."""
    buf = xp.asarray(_dense(c.rank, dtype))
    dest = {None: None, "buf": buf, "other": xp.asarray(np.full(13, -1, dtype))}[out]
    got = c.allreduce(buf, out=dest, op=op)
    work = np.float32 if dtype == np.float16 else dtype
    want = sum(_dense(r, work) for r in range(c.size))
    want = (want / c.size if op == "mean" else want).astype(dtype)
    same = isinstance(got, xp.ndarray) and got.dtype == dtype
    if not (same and np.array_equal(_host(got), want) and (dest is None or got is dest)):
        return f"{got!r} != {want.tolist()}"
    chunks = [n for name, n in c.calls if name.endswith("llreduce")]
    if chunks != ([4, 4, 4, 1] if c.size > 1 else []):
        return f"allreduce calls of {chunks} elements"
    moved = 2 * (c.size - 1) * 13 * np.dtype(work).itemsize // c.size
    msgs = 2 * math.ceil(math.log2(c.size))
    sent = (c.stats.bytes_sent, c.stats.messages_sent)
    if sent != (moved, msgs):
        return f"sent {sent}, an allreduce sends {(moved, msgs)}"
    return None


@pytest.mark.parametrize("poll", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("out", [None, "buf", "other"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_allreduce_past_the_count_limit(comm, int_counts, poll, dtype, out, op):
    c = int_counts(comm, 4, poll)
    why = _problem(_allreduce_problem, c, np, dtype, out, op)
    assert_all(comm, why is None, why)


def test_one_call_each_with_large_counts(comm, int_counts, capsys):
    """A library with the large-count calls (MPICH 4) gets no split at all: one allreduce
    of all 13 elements, one Allgatherv, point-to-point messages of plain bytes."""
    c = int_counts(comm, 3, large=True)
    problems = [_problem(_allgatherv_problem, c, np)]
    got = c.allreduce(_dense(c.rank, np.float32))
    want = sum(_dense(r, np.float32) for r in range(c.size))
    problems += [None if np.array_equal(got, want) else f"sum {got.tolist()}"]
    problems += [_point_to_point_problem(comm, capsys, c, np)]
    sizes = [4 * len(_part(r)) for r in range(c.size)]
    largest = max(sizes[-1], sum(sizes[:-1]))  # (of the allgatherv's counts and displacements)
    a, b = 4 * len(_ring(c.rank)), 4 * len(_ring((c.rank - 1) % c.size))
    want_calls = [("Allgatherv", largest), ("Allreduce", 13)] * (c.size > 1)
    want_calls += [("Sendrecv", max(a, b)), ("Irecv", b), ("Isend", a)]
    problems.append(None if c.calls == want_calls else f"calls {c.calls}")
    problems = [p for p in problems if p]
    assert_all(comm, not problems, "; ".join(problems))


@pytest.mark.parametrize("name", ["dense", "exdyna"])
def test_dense_allreduce_algorithms_past_the_count_limit(comm, int_counts, capsys, name):
    """dense sums all n = 300 values, exdyna its k = 30 selected ones: in chunks of 7."""
    _same_past_the_limit(comm, capsys, name, 7, lambda: int_counts(comm, 7))


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


def _alltoallv_problem(c, xp) -> str | None:
    P, me = c.size, c.rank
    counts = _sendcounts(me, P)
    send = np.concatenate([_chunk(me, j, n) for j, n in enumerate(counts)])
    got, recvcounts = c.alltoallv(xp.asarray(send), counts)
    want_counts = [_sendcounts(r, P)[me] for r in range(P)]
    want = np.concatenate([_chunk(r, me, n) for r, n in enumerate(want_counts)])
    if recvcounts != want_counts or not isinstance(got, xp.ndarray):
        return f"got {got!r} {recvcounts}"
    if not np.array_equal(_host(got), want):
        return f"got {_host(got).tolist()}"
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
    return None if stats == want_stats else f"stats {stats} != {want_stats}"


@pytest.mark.parametrize("poll", [False, True])
@pytest.mark.parametrize("limit", [10, 4])
def test_alltoallv_past_the_count_limit(comm, int_counts, poll, limit):
    """The limit lowered to 10 bytes (some ranks' counts or displacements pass it, the
    others' not: all of them go point to point), then 4 (every message does)."""
    why = _problem(_alltoallv_problem, int_counts(comm, limit, poll), np)
    assert_all(comm, why is None, why)


def test_alltoallv_within_the_count_limit(comm, int_counts):
    """Nothing past the limit on any rank: the one Alltoallv."""
    c = int_counts(comm, 4 * 5 * 8)
    counts = _sendcounts(c.rank, c.size)
    send = np.concatenate([_chunk(c.rank, j, n) for j, n in enumerate(counts)])
    c.alltoallv(send, counts)
    names = {name for name, _ in c.calls}
    assert_all(comm, names == {"Alltoallv"}, f"payload calls {names}")


def _recv_bytes_problem(comm, c, xp) -> str | None:
    """A ring of isend and recv_bytes (the sends started everywhere before any receive)."""
    dest, src = (c.rank + 1) % c.size, (c.rank - 1) % c.size
    mine = xp.asarray(_ring(c.rank)).view(np.uint8)
    reqs, problem = _started(comm, [lambda: c.isend(mine, dest, 6)])
    if problem:
        return problem
    try:  # (a receive that raises fails every rank, none left waiting in the assertion)
        got = c.recv_bytes(src, 6, xp)
    except Exception as exc:
        got = exc
    reqs[0].wait()
    ok = isinstance(got, xp.ndarray) and np.array_equal(_host(got).view(np.float32), _ring(src))
    ok = ok and c.stats.bytes_recv == (got.size if c.size > 1 else 0)
    return None if ok else f"from {src}: {got!r}"


@pytest.mark.parametrize("poll", [False, True])
def test_recv_bytes_past_the_count_limit(comm, int_counts, poll):
    """The limit lowered to 12 bytes: a ring where rank 0's 8 bytes arrive plain, the others'
    past the limit (MPI_Get_count cannot say how many: Get_elements does)."""
    why = _recv_bytes_problem(comm, int_counts(comm, 12, poll), np)
    assert_all(comm, why is None, why)


@pytest.mark.parametrize("aware", [False, True], ids=["staged", "cuda_aware"])
@pytest.mark.parametrize("poll", [False, True])
def test_device_buffers_past_the_count_limit(comm, int_counts, capsys, poll, aware):
    """The split paths with (fake) CuPy arrays, staged through pinned host memory or handed
    to a CUDA-aware MPI as they are, at the limits of the tests above."""

    def lowered(limit):
        c = int_counts(comm, limit, poll)
        c.cuda_aware = aware
        return c

    problems = []
    with fakecupy.installed() as xp:
        pinned = len(xp.pinned_allocations)
        for dtype in (np.float32, np.float16):
            for out in (None, "buf", "other"):
                op = "mean" if out == "other" else "sum"
                why = _problem(_allreduce_problem, lowered(4), xp, dtype, out, op)
                problems.append(why and f"allreduce {np.dtype(dtype)} out={out}: {why}")
        problems.append(_problem(_allgatherv_problem, lowered(3), xp))
        problems.append(_problem(_alltoallv_problem, lowered(4), xp))
        problems.append(_point_to_point_problem(comm, capsys, lowered(12), xp))
        problems.append(_recv_bytes_problem(comm, lowered(12), xp))
        staged = len(xp.pinned_allocations) > pinned
    if comm.size > 1 and staged == aware:
        problems.append(f"pinned staging {'used' if staged else 'unused'}")
    problems = [p for p in problems if p]
    assert_all(comm, not problems, "; ".join(problems))


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
