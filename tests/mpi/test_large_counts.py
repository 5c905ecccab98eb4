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


@pytest.mark.skipif(
    os.environ.get("SPARSECOLL_BIG") != "1", reason="set SPARSECOLL_BIG=1 (about 6 GiB)"
)
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
