"""Nonblocking calls in whole jobs: exit with requests pending, the watchdog's abort, the
thread-level check (each test launches this very file under mpiexec, with a timeout).

tests/mpi/test_nonblocking.py checks the results; these check how jobs end.
"""

from __future__ import annotations

import sys
import time

import pytest

WATCHDOG_SECONDS = 3


@pytest.mark.mpi
def test_exit_with_requests_pending():
    from .mpirun import run_mpi

    proc = run_mpi(3, [__file__, "pending"], timeout=120)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert proc.stdout.count("completed at exit: 6 of 6") == 3, proc.stdout[-6000:]


@pytest.mark.mpi
def test_watchdog_aborts_with_a_diagnostic():
    from .mpirun import run_mpi

    start = time.monotonic()
    env = {"SPARSECOLL_TIMEOUT": str(WATCHDOG_SECONDS)}
    proc = run_mpi(3, [__file__, "skip"], timeout=120, env=env)
    out = proc.stdout
    assert proc.returncode != 0, out[-6000:]
    assert "not reached" not in out, out[-6000:]
    # the ranks waiting in call #3 say so; the rank that skipped it answers the alarm
    for rank in (0, 2):
        assert f"sparsecoll watchdog: rank {rank} of 3: in call #3 iallreduce" in out, out
    assert "sparsecoll watchdog: rank 1 of 3: idle after call #2" in out, out
    assert "timed out in its call #3" in out, out
    assert time.monotonic() - start < 100


@pytest.mark.mpi
def test_watchdog_watches_blocking_reducer_steps():
    """GradientReducer.step (the synchronous DDP hook's call) is watched too: a rank that
    skips a step ends the job with the diagnostic instead of hanging."""
    from .mpirun import run_mpi

    env = {"SPARSECOLL_TIMEOUT": str(WATCHDOG_SECONDS)}
    proc = run_mpi(3, [__file__, "skip_step"], timeout=120, env=env)
    out = proc.stdout
    assert proc.returncode != 0, out[-6000:]
    assert "not reached" not in out, out[-6000:]
    for rank in (0, 2):
        assert f"sparsecoll watchdog: rank {rank} of 3: in call #2 step('oktopk')" in out, out
    assert "sparsecoll watchdog: rank 1 of 3: idle after call #1 step('oktopk')" in out, out


@pytest.mark.mpi
def test_uncaught_exception_with_requests_pending_ends_the_job():
    """One rank dies of an uncaught exception with requests pending, the others exit
    normally: without the abort the job hung (that rank in MPI_Finalize, waiting for the
    others; they at exit, in the pending calls, which need it)."""
    from .mpirun import run_mpi

    start = time.monotonic()
    proc = run_mpi(3, [__file__, "raise"], timeout=120)
    out = proc.stdout
    assert proc.returncode != 0, out[-6000:]
    assert "RuntimeError: rank 1 fails" in out, out[-6000:]
    assert "sparsecoll: rank 1 of 3: uncaught exception with" in out, out[-6000:]
    assert time.monotonic() - start < 100


@pytest.mark.mpi
def test_thread_level_is_checked():
    from .mpirun import run_mpi

    proc = run_mpi(1, [__file__, "serialized"], timeout=120)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "need MPI_THREAD_MULTIPLE" in proc.stdout, proc.stdout[-6000:]
    assert "MPI_THREAD_SERIALIZED" in proc.stdout, proc.stdout[-6000:]


def _inputs(rank: int):
    import numpy as np

    rng = np.random.default_rng(rank)
    return rng.standard_normal(500).astype(np.float32), rng.integers(0, 10**5, 500)


def _pending() -> None:
    import atexit

    import numpy as np

    import sparsecoll

    comm = sparsecoll.Communicator()
    vals, idx = _inputs(comm.rank)
    reqs = []
    # registered before sparsecoll's own exit handler, so it runs after it
    atexit.register(
        lambda: print(f"completed at exit: {sum(r.done() for r in reqs)} of {len(reqs)}")
    )
    reqs += [sparsecoll.iallreduce(comm, vals, idx, n=10**5) for _ in range(4)]
    red = sparsecoll.GradientReducer(comm, 1000, "allgather", 0.1)
    reqs += [red.step_async(np.ones(1000, np.float32) * comm.rank) for _ in range(2)]
    print(f"rank {comm.rank} exits, {sum(not r.done() for r in reqs)} pending", flush=True)


def _raise() -> None:
    import sparsecoll

    comm = sparsecoll.Communicator()
    vals, idx = _inputs(comm.rank)
    sparsecoll.iallreduce(comm, vals, idx, n=10**5).wait()
    if comm.rank != 1:  # late: rank 1's calls cannot have completed when it reaches exit
        time.sleep(2)
    for _ in range(4):
        sparsecoll.iallreduce(comm, vals, idx, n=10**5)
    if comm.rank == 1:
        raise RuntimeError("rank 1 fails")


def _skip() -> None:
    import sparsecoll

    assert sparsecoll.get_timeout() == WATCHDOG_SECONDS
    comm = sparsecoll.Communicator()
    vals, idx = _inputs(comm.rank)
    sparsecoll.set_timeout(None)  # the first call loads the kernels: not watched
    sparsecoll.iallreduce(comm, vals, idx, n=10**5).wait()
    sparsecoll.set_timeout(WATCHDOG_SECONDS)
    sparsecoll.iallreduce(comm, vals, idx, n=10**5).wait()
    if comm.rank != 1:  # rank 1 skips call #3
        sparsecoll.iallreduce(comm, vals, idx, n=10**5, algorithm="allgather").wait()
    comm.mpi_comm.Barrier()  # raw MPI, not watched; rank 1 waits here
    print("not reached", flush=True)


def _skip_step() -> None:
    import numpy as np

    import sparsecoll

    comm = sparsecoll.Communicator()
    red = sparsecoll.GradientReducer(comm, 10**4, "oktopk", 0.01)
    grad = np.random.default_rng(comm.rank).standard_normal(10**4).astype(np.float32)
    sparsecoll.set_timeout(None)  # the first step loads the kernels: not watched
    red.step(grad)
    sparsecoll.set_timeout(WATCHDOG_SECONDS)
    red.step(grad)
    if comm.rank != 1:  # rank 1 skips step #3 (the engine's call #2)
        red.step(grad)
    comm.mpi_comm.Barrier()  # raw MPI, not watched; rank 1 waits here
    print("not reached", flush=True)


def _serialized() -> None:
    import mpi4py

    mpi4py.rc.thread_level = "serialized"
    import sparsecoll

    try:
        sparsecoll.iallreduce(sparsecoll.Communicator(), *_inputs(0), n=10**5)
    except RuntimeError as exc:
        print(exc)


if __name__ == "__main__":
    modes = {"pending": _pending, "skip": _skip, "skip_step": _skip_step, "raise": _raise}
    modes["serialized"] = _serialized
    modes[sys.argv[1]]()
