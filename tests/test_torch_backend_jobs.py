"""The "sparsecoll" torch.distributed backend in whole jobs: under mpiexec the process group's
``timeout`` is the watchdog's, so a rank that skips an all_reduce, or is stuck in a sparse
one, ends the job with the watchdog's diagnostic within about that timeout; under torchrun
the waiting ranks raise at that timeout (each test launches this very file under mpiexec,
SPARSECOLL_TIMEOUT unset, or torchrun, with a timeout).

tests/mpi/test_torch_backend.py checks the results; these check how jobs end.
"""

from __future__ import annotations

import sys
import time

import pytest

PG_SECONDS = 3  # the process group's timeout in these jobs


def _aborted(nprocs: int, mode: str) -> str:
    """The output of this file's ``mode`` on ``nprocs`` ranks, checked to have been aborted
    (not hung, nor run to its end) within 100 s."""
    pytest.importorskip("torch")
    from .mpirun import run_mpi

    start = time.monotonic()
    proc = run_mpi(nprocs, [__file__, mode], timeout=120, env={"SPARSECOLL_TIMEOUT": ""})
    out = proc.stdout
    assert proc.returncode != 0, out[-6000:]
    assert "not reached" not in out, out[-6000:]
    assert time.monotonic() - start < 100, out[-6000:]
    return out


WHY = f"timeout {PG_SECONDS} s expired (the process group's timeout); aborting the job"
SPARSE = "all_reduce(sparse tensor of shape (8, 3))"


@pytest.mark.mpi
def test_a_rank_that_skips_an_all_reduce_ends_the_job():
    """Rank 1 skips the second all_reduce (sparse): the others wait in its agreement until
    the group's timeout, then the watchdog names where each rank is and aborts."""
    out = _aborted(3, "skip")
    for rank in (0, 2):
        assert f"rank {rank} of 3: in call #2 {SPARSE} for" in out, out[-6000:]
    assert WHY in out, out[-6000:]
    assert f"rank 1 idle after call #1 {SPARSE}" in out, out[-6000:]


@pytest.mark.mpi
def test_a_rank_that_skips_the_first_all_reduce_ends_the_job():
    """Rank 1 skips the group's first all_reduce (dense), where the agreements' engine
    starts: the others abort there at the group's timeout."""
    out = _aborted(2, "skip_first")
    want = (
        "rank 0 of 2: in the start of the communicator's progress engine (for "
        "all_reduce(dense tensor of shape (3,)))"
    )
    assert want in out, out[-6000:]
    assert "(the process group's timeout); aborting the job" in out, out[-6000:]


@pytest.mark.mpi
def test_a_rank_stuck_in_a_sparse_all_reduce_ends_the_job():
    """Rank 1's progress thread is stuck (in a call of its own) when every rank makes a
    sparse all_reduce: the others wait in its messages until the group's timeout, then
    the progress engine's watchdog aborts, naming rank 1's call."""
    out = _aborted(2, "stuck")
    assert f"rank 0 of 2: in call #2 {SPARSE} for" in out, out[-6000:]
    assert WHY in out, out[-6000:]
    assert "rank 1 in call #2 stuck" in out or "rank 1 of 2: in call #2 stuck" in out, out[-6000:]


@pytest.mark.mpi
def test_a_rank_that_skips_an_all_reduce_ends_the_job_under_torchrun():
    """Under torchrun the agreement is gloo's: the ranks waiting there raise at the group's
    timeout, naming the call, and torchrun ends the job."""
    pytest.importorskip("torch")
    from .test_torchrun import run_torchrun

    start = time.monotonic()
    proc, hung = run_torchrun(2, [__file__, "torchrun_skip"], idle=100)
    out = proc.stdout
    assert not hung and proc.returncode != 0, out[-6000:]
    assert "not reached" not in out, out[-6000:]
    assert time.monotonic() - start < 100, out[-6000:]
    want = f"RuntimeError: {SPARSE} on rank 0: the ranks' agreement on the call failed"
    assert want in out, out[-6000:]


def _job(mode: str) -> None:
    import datetime

    import numpy as np
    import torch
    import torch.distributed as dist

    from sparsecoll.integrations import torch as sc_torch

    timeout = datetime.timedelta(seconds=PG_SECONDS)
    if mode.startswith("torchrun"):
        dist.init_process_group("sparsecoll", timeout=timeout)
    else:
        sc_torch.init_process_group(backend="sparsecoll", timeout=timeout)
    rank = dist.get_rank()
    sparse = torch.sparse_coo_tensor([[rank, 5]], torch.ones(2, 3), (8, 3))
    if mode == "skip_first":
        if rank != 1:
            dist.all_reduce(torch.ones(3))
    else:
        dist.all_reduce(sparse.clone())
        if mode == "stuck" and rank == 1:  # (its sparse calls queue behind this one)
            dist.group.WORLD.comm.engine().submit(lambda: time.sleep(600), "stuck")
        if mode == "stuck" or rank != 1:
            dist.all_reduce(sparse.clone())
    if mode.startswith("torchrun"):
        time.sleep(200)
    else:  # raw MPI, not watched; rank 1 waits here
        from mpi4py import MPI

        MPI.COMM_WORLD.Recv(np.empty(1), source=0, tag=77)
    print("not reached", flush=True)


if __name__ == "__main__":
    _job(sys.argv[1])
