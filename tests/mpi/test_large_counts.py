"""Payloads past MPI-3's int counts (2**31 - 1 bytes) on MPI libraries without the MPI-4
large-count calls (Open MPI 5.0: mpi4py raised MPI_ERR_ARG there)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import sparsecoll
import sparsecoll.comm as scomm
from sparsecoll import Communicator

from .cases import assert_all


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


@pytest.mark.parametrize("name", ["rabenseifner", "recursive_doubling", "dsa", "gtopk"])
def test_point_to_point_algorithms_past_the_count_limit(comm, monkeypatch, name):
    rng = np.random.default_rng([5, comm.rank])
    idx = rng.integers(0, 300, 60)
    vals = rng.standard_normal(60).astype(np.float32)
    opts = {"k": 30} if name == "gtopk" else {}
    want = sparsecoll.allreduce(comm, vals, idx, n=300, algorithm=name, **opts)
    monkeypatch.setattr(scomm, "COUNT_MAX", 9)
    monkeypatch.setattr(scomm, "_large_counts", lambda: False)
    got = sparsecoll.allreduce(comm, vals, idx, n=300, algorithm=name, **opts)
    assert_all(comm, np.array_equal(got.indices, want.indices), "indices differ")
    assert_all(comm, np.array_equal(got.values, want.values), "values differ")


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
