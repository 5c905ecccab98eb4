"""Nonblocking calls in whole jobs: exit with requests pending, the watchdog's abort, the
thread-level check (each test but the registry lock one launches this very file under mpiexec,
with a timeout).

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
@pytest.mark.parametrize(
    ("mode", "waiting", "idle"),
    [
        ("skip", "in call #3 iallreduce", "idle after call #2"),
        # a blocking GradientReducer.step (the synchronous DDP hook's call) is watched too;
        # its first step ran unwatched, so the engine's call numbers are one lower
        ("skip_step", "in call #2 step('oktopk')", "idle after call #1 step('oktopk')"),
        # rank 1 skips the call and exits: it prints nothing, the rank that fired names it
        ("skip_exit", "in call #3 iallreduce", None),
    ],
)
def test_watchdog_aborts_with_a_diagnostic(mode, waiting, idle):
    out = _aborted_by_the_watchdog(3, mode)
    # the ranks waiting in the call say so; the rank that skipped it answers the alarm
    for rank in (0, 2):
        assert f"sparsecoll watchdog: rank {rank} of 3: {waiting}" in out, out
    if idle is not None:
        assert f"sparsecoll watchdog: rank 1 of 3: {idle}" in out, out
        assert "timed out in its call #" in out, out
    # the rank that fired sums up from the others' answers: who is in its call, who is not
    summary = [line for line in out.splitlines() if waiting[3:] in line and " in it" in line]
    assert summary, out
    absent = f"rank 1 {idle}" if idle else "rank 1 did not answer within"
    assert any(absent in line for line in summary), out


def _aborted_by_the_watchdog(nprocs: int, mode: str) -> str:
    """The output of this file's ``mode`` run on ``nprocs`` ranks under SPARSECOLL_TIMEOUT,
    checked to have been aborted (not hung, nor run to its end) within 100 s."""
    from .mpirun import run_mpi

    start = time.monotonic()
    env = {"SPARSECOLL_TIMEOUT": str(WATCHDOG_SECONDS)}
    proc = run_mpi(nprocs, [__file__, mode], timeout=120, env=env)
    out = proc.stdout
    assert proc.returncode != 0, out[-6000:]
    assert "not reached" not in out, out[-6000:]
    assert time.monotonic() - start < 100
    return out


@pytest.mark.mpi
def test_watchdog_aborts_when_a_rank_skips_the_first_call():
    """The first nonblocking (or, under the watchdog, blocking) call on a communicator
    starts its progress engine, collectively, before any engine can watch: a rank that
    skipped it left the others there for ever under SPARSECOLL_TIMEOUT (the job hung)."""
    out = _aborted_by_the_watchdog(3, "skip_first")
    waiting = "in the start of the communicator's progress engine (for iallreduce("
    assert any(f"rank {r} of 3: {waiting}" in out for r in (0, 2)), out[-6000:]


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("mode", "label"),
    [
        ("skip_load", "load_state_dict('allgather')"),
        ("skip_dense", "Communicator.allreduce(op='sum')"),
        ("skip_hook_load", "SparseHookState.load_state_dict()"),
        ("skip_init", "init_process_group()"),
        # the Communicator's methods called directly: a collective, and point-to-point
        ("skip_barrier", "Communicator.barrier()"),
        ("skip_send", "Communicator.recv()"),
        # an NCCLCommunicator's payload and construction (tests/fakecupy's NCCL: MPI)
        ("skip_nccl", "NCCLCommunicator.allreduce(op='sum')"),
        ("skip_nccl_init", "NCCLCommunicator()"),
    ],
)
def test_watchdog_aborts_when_a_rank_skips_another_blocking_call(mode, label):
    """Collectives of the public API besides the reductions, watched as blocking calls:
    rank 1 skips one (after a watched allreduce, call #1). They ran unwatched, so the other
    rank waited in their agreement (or exchange) for ever under SPARSECOLL_TIMEOUT (so did
    rank 0 in a Communicator's barrier, or in its recv of a send that rank 1 skipped)."""
    if mode in ("skip_hook_load", "skip_init"):
        pytest.importorskip("torch")
    out = _aborted_by_the_watchdog(2, mode)
    assert f"sparsecoll watchdog: rank 0 of 2: in call #2 {label} for" in out, out[-6000:]
    idle = "rank 1 idle after call #1 allreduce(algorithm='allgather', n=9)"
    assert f"call #2 {label}: rank 0 in it; {idle}" in out, out[-6000:]


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
@pytest.mark.parametrize("level", ["single", "funneled", "serialized"])
def test_thread_level_is_checked(level):
    """Below MPI_THREAD_MULTIPLE, iallreduce raises on every rank and blocking calls work,
    under the watchdog too (they run unwatched, with a warning: they raised iallreduce's
    RuntimeError)."""
    from .mpirun import run_mpi

    proc = run_mpi(2, [__file__, level], timeout=120)
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:]
    assert out.count("need MPI_THREAD_MULTIPLE") == 2, out[-6000:]
    assert out.count(f"MPI_THREAD_{level.upper()}") == 2, out[-6000:]
    assert out.count("blocking: [2.0, 4.0]") == 2, out[-6000:]
    want = "blocking under the watchdog: [2.0, 4.0] [0.0, 1.0, 0.0, 2.0]"
    assert out.count(want) == 2, out[-6000:]
    assert out.count("RuntimeWarning: the watchdog (SPARSECOLL_TIMEOUT) needs") == 2, out


FORK_WHILE_LOCKED = """
import os, signal, sys, time
from sparsecoll import _progress

with _progress._registry_lock:  # (as another thread creating an engine holds it)
    pid = os.fork()
    if pid == 0:  # the child
        _progress.shutdown()
        os._exit(0)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        sys.exit(os.waitstatus_to_exitcode(status))
    time.sleep(0.05)
os.kill(pid, signal.SIGKILL)
os.waitpid(pid, 0)
sys.exit("the forked child's exit handler hung on the registry lock")
"""


def test_a_child_forked_while_the_engine_registry_is_locked_exits():
    """A fork while another thread holds the engine registry's lock (making an engine): the
    child gets a new lock, so its exit handler does not wait for ever on a lock copied
    locked into a child with no thread to release it. (In a fresh interpreter: this one
    may hold other libraries' threads, which a fork does not mix with.)"""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", FORK_WHILE_LOCKED], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.mpi
def test_fork_after_the_progress_thread_started():
    """A child forked with a request pending: its calls raise instead of hanging (they
    were queued to a thread the child does not have; waiting for the parent's request hung
    too), and its exit handler, for an uncaught
    exception, leaves the job alone (it called MPI_Abort, ending the parent's job)."""
    from .mpirun import run_mpi

    proc = run_mpi(2, [__file__, "fork"], timeout=120)
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:]
    assert out.count("child: submit raised RuntimeError: process") == 2, out[-6000:]
    assert out.count("child: drain raised RuntimeError: process") == 2, out[-6000:]
    assert out.count("child: wait raised RuntimeError: gate (call #1) was pending") == 2, out
    assert out.count("child: exit handler returned") == 2, out[-6000:]
    assert out.count("parent: [2.0, 4.0]") == 2, out[-6000:]


@pytest.mark.mpi
def test_watchdog_times_a_blocking_call_from_when_the_requests_before_it_end():
    """A blocking call made while requests are pending waits for them first; the watchdog
    timed it from its start, that wait included: requests of a quarter of the timeout
    each, twice the timeout in all, aborted the job in the blocking call after them."""
    from .mpirun import run_mpi

    env = {"SPARSECOLL_TIMEOUT": str(WATCHDOG_SECONDS)}
    proc = run_mpi(2, [__file__, "queued"], timeout=120, env=env)
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:]
    assert "sparsecoll watchdog" not in out, out[-6000:]
    assert out.count("blocking after the requests: [2.0, 4.0], 8 done") == 2, out[-6000:]


@pytest.mark.mpi
def test_watchdog_watches_blocking_calls_after_the_engine_is_closed():
    """With SPARSECOLL_TIMEOUT set, closing a communicator's progress engine left its later
    blocking calls unwatched, without a word: a rank late by four timeouts went unnoticed
    (the job ended normally). They stay watched: the job aborts with the diagnostic."""
    from .mpirun import run_mpi

    env = {"SPARSECOLL_TIMEOUT": str(WATCHDOG_SECONDS)}
    proc = run_mpi(3, [__file__, "closed"], timeout=120, env=env)
    out = proc.stdout
    assert proc.returncode != 0, out[-6000:]
    assert "not reached" not in out, out[-6000:]
    for rank in (0, 2):
        assert f"sparsecoll watchdog: rank {rank} of 3: in call #3 allreduce" in out, out


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("mode", "says", "count"),
    [
        # a daemon thread goes on making watched blocking calls at exit (the ranks agree when
        # to stop in an exit handler that runs after sparsecoll's): the exit handler waited
        # for the watchdog, which lived as long as blocking calls ran: the exit hung for ever.
        # It waits for the calls in flight then only, and those after are not watched.
        ("daemon", "the daemon thread stopped: True", 2),
        # a daemon thread of rank 0 is in a watched blocking call that rank 1 never makes:
        # the exit waits for it until the watchdog aborts the job, with its diagnostic
        # (without it, MPI_Finalize ran under the call: MPICH crashed)
        ("stuck", "sparsecoll watchdog: rank 0 of 2: in call #2 allreduce", 1),
    ],
)
def test_exit_with_a_daemon_thread_in_blocking_calls(mode, says, count):
    from .mpirun import run_mpi

    env = {"SPARSECOLL_TIMEOUT": str(WATCHDOG_SECONDS)}
    proc = run_mpi(2, [__file__, mode], timeout=120, env=env)
    out = proc.stdout
    assert (proc.returncode == 0) == (mode == "daemon"), out[-6000:]
    assert ("sparsecoll watchdog" in out) == (mode == "stuck"), out[-6000:]
    assert out.count(says) == count, out[-6000:]


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["interrupt_request", "interrupt_blocking"])
def test_interrupt_while_the_exit_waits(mode):
    """Ctrl-C (SIGINT) on rank 0 while its exit waits for a call that rank 1 never makes (a
    request; a daemon thread's watched blocking call): the KeyboardInterrupt was ignored in
    the exit handler, and MPI finalized under the call (the job hung; MPICH crashed).
    sparsecoll aborts the job instead, saying why, before the watchdog's timeout."""
    from .mpirun import run_mpi

    proc = run_mpi(2, [__file__, mode], timeout=120)
    out = proc.stdout
    assert proc.returncode != 0, out[-6000:]
    assert "sparsecoll: rank 0 of 2: interrupted at exit with 1 call(s) in progress" in out, out
    assert "sparsecoll watchdog" not in out, out[-6000:]


def _interrupt(blocking: bool) -> None:
    import os
    import signal
    import threading

    import sparsecoll

    comm, vals, idx = _watched()
    sparsecoll.set_timeout(100)  # on, but longer than the test waits
    sparsecoll.allreduce(comm, vals, idx, n=9)  # watched: starts the engine on every rank
    if comm.rank == 0:
        if blocking:
            call = lambda: sparsecoll.allreduce(comm, vals, idx, n=9)  # noqa: E731
            threading.Thread(target=call, daemon=True).start()
        else:
            sparsecoll.iallreduce(comm, vals, idx, n=9)

        def interrupt() -> None:  # once rank 0 waits at exit
            time.sleep(2)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt, daemon=True).start()


def _watched():
    """The communicator and small inputs, the watchdog on once a first call has loaded the
    kernels (unwatched)."""
    import numpy as np

    import sparsecoll

    comm = sparsecoll.Communicator()
    vals, idx = np.array([1.0, 2.0], np.float32), np.array([3, 4])
    sparsecoll.set_timeout(None)  # the first call loads the kernels: not watched
    sparsecoll.allreduce(comm, vals, idx, n=9)
    sparsecoll.set_timeout(WATCHDOG_SECONDS)
    return comm, vals, idx


def _daemon() -> None:
    import atexit
    import threading

    import numpy as np

    import sparsecoll

    comm, _, _ = _watched()
    exiting = threading.Event()
    idx = np.array([comm.rank])

    def loop() -> None:  # until a rank's exit handler says stop (the ranks stop together)
        while not sparsecoll.allreduce(comm, np.float32([exiting.is_set()]), idx, n=9).values.any():
            pass

    def stop() -> None:
        exiting.set()
        thread.join(10 * WATCHDOG_SECONDS)
        print(f"the daemon thread stopped: {not thread.is_alive()}", flush=True)

    thread = threading.Thread(target=loop, daemon=True)
    atexit.register(stop)  # before sparsecoll's exit handler (the first watched call's)
    thread.start()
    time.sleep(1)


def _stuck() -> None:
    import threading

    import sparsecoll

    comm, vals, idx = _watched()
    sparsecoll.allreduce(comm, vals, idx, n=9)  # call #1
    if comm.rank == 0:  # call #2, on rank 0 only
        call = lambda: sparsecoll.allreduce(comm, vals, idx, n=9)  # noqa: E731
        threading.Thread(target=call, daemon=True).start()
    time.sleep(0.5)


def _closed() -> None:
    import sparsecoll

    comm, vals, idx = _watched()
    sparsecoll.iallreduce(comm, vals, idx, n=9).wait()  # call #1
    sparsecoll.allreduce(comm, vals, idx, n=9)  # call #2: the watchdog runs
    comm.engine().close()
    if comm.rank == 1:  # late to call #3 by four timeouts
        time.sleep(4 * WATCHDOG_SECONDS)
    sparsecoll.allreduce(comm, vals, idx, n=9)
    print("not reached", flush=True)


def _queued() -> None:
    import numpy as np

    import sparsecoll

    comm = sparsecoll.Communicator()
    engine = comm.engine()
    vals, idx = np.array([1.0, 2.0], np.float32), np.array([3, 4])
    sparsecoll.set_timeout(None)  # the first call loads the kernels: not watched
    sparsecoll.allreduce(comm, vals, idx, n=9)
    sparsecoll.set_timeout(WATCHDOG_SECONDS)
    # local calls (no MPI) that each take a quarter of the timeout
    reqs = [engine.submit(lambda: time.sleep(WATCHDOG_SECONDS / 4), "sleep") for _ in range(8)]
    out = sparsecoll.allreduce(comm, vals, idx, n=9).values.tolist()
    done = sum(r.done() for r in reqs)
    print(f"blocking after the requests: {out}, {done} done", flush=True)


def _fork() -> None:
    import os
    import threading

    import numpy as np

    import sparsecoll
    from sparsecoll import _progress

    comm = sparsecoll.Communicator()
    engine = comm.engine()
    gate = threading.Event()
    pending = engine.submit(gate.wait, "gate")  # local: pending while the child runs
    pid = os.fork()
    if pid == 0:
        for name, call in (
            ("submit", lambda: engine.submit(int, "local")),
            ("drain", engine.drain),
            ("wait", pending.wait),
        ):
            try:
                call()
                print(f"child: {name} returned", flush=True)
            except RuntimeError as exc:
                print(f"child: {name} raised RuntimeError: {exc}", flush=True)
        sys.last_value = sys.last_exc = RuntimeError("the child fails")  # as if uncaught
        _progress.shutdown()  # what the exit handler does then
        print("child: exit handler returned", flush=True)
        os._exit(0)  # (the child must not finalize MPI: it would break the parent's)
    os.waitpid(pid, 0)
    gate.set()
    pending.wait()
    vals, idx = np.array([1.0, 2.0], np.float32), np.array([3, 4])
    out = sparsecoll.iallreduce(comm, vals, idx, n=9).wait().values.tolist()
    print(f"parent: {out}", flush=True)


@pytest.mark.mpi
def test_finalize_with_requests_pending():
    """MPI.Finalize() called with requests pending (one rank late): they complete first, and
    a later call raises. The progress thread went on calling MPI after it (MPICH: "Attempting
    to use an MPI routine ... after finalizing", the job failed)."""
    from .mpirun import run_mpi

    proc = run_mpi(2, [__file__, "finalize"], timeout=120)
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:]
    assert out.count("finalized, done: [True, True, True]") == 2, out[-6000:]
    assert out.count("then: RuntimeError") == 2, out[-6000:]


def _finalize() -> None:
    from mpi4py import MPI

    import sparsecoll

    comm = sparsecoll.Communicator()
    vals, idx = _inputs(comm.rank)
    reqs = [sparsecoll.iallreduce(comm, vals, idx, n=10**5) for _ in range(3)]
    if comm.rank == 0:
        time.sleep(1)
    MPI.Finalize()
    print(f"finalized, done: {[r.done() for r in reqs]}", flush=True)
    try:
        comm.engine().submit(int, "local")
    except RuntimeError as exc:
        print(f"then: RuntimeError: {exc}", flush=True)


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


def _skip(exits: bool = False) -> None:
    """Rank 1 skips call #3 and waits in raw MPI (``exits``: exits instead)."""
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
    if not exits:
        comm.mpi_comm.Barrier()  # raw MPI, not watched; rank 1 waits here
        print("not reached", flush=True)
    elif comm.rank != 1:
        print("not reached", flush=True)


def _skip_blocking(mode: str) -> None:
    """Rank 1 skips call #2 (``mode``: which) and waits in raw MPI."""
    import numpy as np

    import sparsecoll

    comm, vals, idx = _watched()
    if mode.startswith("skip_nccl"):
        from tests import fakecupy

        fake = fakecupy.installed()  # (for the rest of the process: kept, as it is left)
        fake.__enter__()
        from sparsecoll.nccl import NCCLCommunicator

        sparsecoll.set_timeout(None)
        nc = NCCLCommunicator(comm) if mode == "skip_nccl" else None
        sparsecoll.set_timeout(WATCHDOG_SECONDS)
    sparsecoll.allreduce(comm, vals, idx, n=9)  # call #1: the engine starts
    if comm.rank != 1:
        if mode == "skip_nccl":
            nc.allreduce(fakecupy.module.ones(4, np.float32))
        elif mode == "skip_nccl_init":
            NCCLCommunicator(comm)
        elif mode == "skip_load":
            red = sparsecoll.GradientReducer(comm, 4, "allgather", 0.5)
            red.load_state_dict(red.state_dict())
        elif mode == "skip_dense":
            comm.allreduce(np.ones(4, np.float32))
        elif mode == "skip_barrier":
            comm.barrier()
        elif mode == "skip_send":
            comm.recv(np.empty(4, np.float32), 1)  # (rank 1 skips its send)
        elif mode == "skip_hook_load":
            from sparsecoll.integrations.torch import SparseHookState

            state = SparseHookState(comm, "allgather", 0.5)
            state.load_state_dict(state.state_dict())
        else:
            from sparsecoll.integrations.torch import init_process_group

            init_process_group(comm)
    # raw MPI, not watched; rank 1 waits here (a receive that nothing sends: a Barrier
    # would pair with rank 0's Communicator.barrier)
    comm.mpi_comm.Recv(np.empty(1), source=0, tag=77)
    print("not reached", flush=True)


def _skip_first() -> None:
    """Rank 1 skips the first call on the communicator, which starts its progress engine,
    and waits in raw MPI."""
    import sparsecoll

    comm = sparsecoll.Communicator()
    vals, idx = _inputs(comm.rank)
    if comm.rank != 1:
        sparsecoll.iallreduce(comm, vals, idx, n=10**5).wait()
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


def _low_level(level: str) -> None:
    import mpi4py

    mpi4py.rc.thread_level = level
    import numpy as np

    import sparsecoll

    comm = sparsecoll.Communicator()
    try:
        sparsecoll.iallreduce(comm, *_inputs(comm.rank), n=10**5)
    except RuntimeError as exc:
        print(exc, flush=True)
    vals, idx = np.array([1.0, 2.0], np.float32), np.array([3, 4])
    out = sparsecoll.allreduce(comm, vals, idx, n=9).values.tolist()
    print(f"blocking: {out}", flush=True)  # (one write: the ranks share the output)
    sparsecoll.set_timeout(60)
    out = sparsecoll.allreduce(comm, vals, idx, n=9).values.tolist()
    red = sparsecoll.GradientReducer(comm, 4, "allgather", 0.5)
    step = red.step(np.array([0, 1, 0, 2], np.float32)).tolist()
    print(f"blocking under the watchdog: {out} {step}", flush=True)


if __name__ == "__main__":
    modes = {"pending": _pending, "skip": _skip, "skip_step": _skip_step, "raise": _raise}
    modes.update(skip_first=_skip_first)
    skips = ("load", "dense", "hook_load", "init", "barrier", "send", "nccl", "nccl_init")
    for skipped in (f"skip_{what}" for what in skips):
        modes[skipped] = lambda skipped=skipped: _skip_blocking(skipped)
    modes.update(skip_exit=lambda: _skip(exits=True))
    modes.update(fork=_fork, finalize=_finalize, queued=_queued, closed=_closed)
    modes.update(daemon=_daemon, stuck=_stuck)
    modes.update(
        interrupt_request=lambda: _interrupt(False), interrupt_blocking=lambda: _interrupt(True)
    )
    if sys.argv[1] in ("single", "funneled", "serialized"):
        _low_level(sys.argv[1])
    else:
        modes[sys.argv[1]]()
