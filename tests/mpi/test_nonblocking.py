"""Nonblocking calls under MPI: iallreduce equals allreduce bit for bit (every algorithm,
several requests outstanding), mixed blocking and nonblocking calls, errors through wait(),
step_async equals step, wait(timeout=), byte accounting."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref

import numpy as np
import pytest

import sparsecoll
from sparsecoll.registry import algorithm_class
from sparsecoll.training import GradientReducer

from .cases import assert_all, digest

NAMES = sparsecoll.available_algorithms()
N = 3000
K = 60


def _input(rank: int, seed: int, k: int = K):
    rng = np.random.default_rng([seed, rank])
    idx = rng.integers(0, N, k).astype(np.int64)
    return rng.standard_normal(k).astype(np.float32), idx


def _opts(name: str) -> dict:
    return algorithm_class(name).default_options(N, K)


@pytest.mark.parametrize("name", NAMES)
def test_iallreduce_equals_allreduce(comm, name):
    inputs = [_input(comm.rank, seed) for seed in range(3)]
    reqs = [
        sparsecoll.iallreduce(comm, v, i, n=N, algorithm=name, **_opts(name)) for v, i in inputs
    ]
    got = [r.wait() for r in reqs]
    assert_all(comm, all(r.done() and r.test() for r in reqs))
    want = [sparsecoll.allreduce(comm, v, i, n=N, algorithm=name, **_opts(name)) for v, i in inputs]
    for g, w in zip(got, want):
        assert_all(comm, digest(g) == digest(w), f"{name}: iallreduce differs from allreduce")
        assert_all(comm, g.info["stats"] == w.info["stats"], f"{g.info} != {w.info}")


def test_iallreduce_without_mpi4_isendrecv(comm, monkeypatch):
    """Before MPI 4.0 (Open MPI 4.x, MPICH 3.x) there is no MPI_Isendrecv, and mpi4py
    raises NotImplementedError for it: the progress thread's polling waits then pair an
    Irecv with an Isend, with the same results and bytes."""
    from sparsecoll import _mpilib

    asked = []

    def without(mpi_comm):
        asked.append(1)
        return False

    monkeypatch.setattr(_mpilib, "isendrecv_works", without)
    inputs = [_input(comm.rank, seed) for seed in range(2)]
    for name in NAMES:
        reqs = [
            sparsecoll.iallreduce(comm, v, i, n=N, algorithm=name, **_opts(name)) for v, i in inputs
        ]
        got = [r.wait() for r in reqs]
        want = [
            sparsecoll.allreduce(comm, v, i, n=N, algorithm=name, **_opts(name)) for v, i in inputs
        ]
        for g, w in zip(got, want):
            assert_all(comm, digest(g) == digest(w), f"{name}: iallreduce differs from allreduce")
            assert_all(comm, g.info["stats"] == w.info["stats"], f"{g.info} != {w.info}")
    assert_all(comm, comm.size == 1 or len(asked) > 0, "the fallback never ran")


@pytest.mark.parametrize("setting", ["0", "1"])
def test_progress_poll_setting(comm, monkeypatch, setting):
    """SPARSECOLL_PROGRESS_POLL=0: the progress thread waits in MPI's blocking calls
    (read when an engine starts); results equal allreduce's either way, and bad input on
    one rank raises on every rank through wait()."""
    from mpi4py import MPI

    from sparsecoll import Communicator

    monkeypatch.setenv("SPARSECOLL_PROGRESS_POLL", setting)
    mine = Communicator(MPI.COMM_WORLD.Dup())  # a fresh engine reads the setting
    engine = mine.engine()
    try:
        assert_all(comm, engine.comm.poll == (setting == "1"), "the setting was not applied")
        inputs = [_input(comm.rank, seed) for seed in range(3)]
        for name in ("oktopk", "exdyna", "allgather"):
            reqs = [
                sparsecoll.iallreduce(mine, v, i, n=N, algorithm=name, **_opts(name))
                for v, i in inputs
            ]
            want = [
                sparsecoll.allreduce(comm, v, i, n=N, algorithm=name, **_opts(name))
                for v, i in inputs
            ]
            got = [digest(r.wait()) for r in reqs]
            assert_all(comm, got == [digest(w) for w in want], f"{name}: results differ")
        # bad input on one rank raises the same error everywhere, and the engine goes on
        bad = comm.size - 1
        vals, idx = _input(comm.rank, 1)
        if comm.rank == bad:
            idx = idx.copy()
            idx[3] = N + 5
        try:
            opts = _opts("oktopk")
            sparsecoll.iallreduce(mine, vals, idx, n=N, algorithm="oktopk", **opts).wait()
            err = None
        except sparsecoll.CollectiveInputError as exc:
            err = str(exc)
        assert_all(comm, err is not None and f"rank {bad}" in err, err)
        assert_all(comm, len(set(comm.allgather_object(err))) == 1)
        out = sparsecoll.iallreduce(mine, *_input(comm.rank, 2), n=N).wait()
        assert_all(comm, out.n == N)
    finally:
        engine.close()


def test_mixed_blocking_and_nonblocking(comm):
    inputs = [_input(comm.rank, seed) for seed in range(4)]
    want = [digest(sparsecoll.allreduce(comm, v, i, n=N)) for v, i in inputs]
    first = sparsecoll.iallreduce(comm, *inputs[0], n=N)
    second = sparsecoll.iallreduce(comm, *inputs[1], n=N)
    blocking = sparsecoll.allreduce(comm, *inputs[2], n=N)
    # a blocking call on the communicator is ordered after the requests issued before it
    assert_all(comm, first.done() and second.done(), "blocking call overtook pending requests")
    fourth = sparsecoll.iallreduce(comm.mpi_comm, *inputs[3], n=N)  # a raw mpi4py comm too
    got = [first.wait(), second.wait(), blocking, fourth.wait()]
    assert_all(comm, [digest(g) for g in got] == want, "mixed calls give other results")


def test_stats_of_requests(comm):
    vals, idx = _input(comm.rank, 5)
    with comm.measure() as st:
        out = sparsecoll.iallreduce(comm, vals, idx, n=N).wait()
    with comm.measure() as want:
        ref = sparsecoll.allreduce(comm, vals, idx, n=N)
    # the Communicator counts its requests' traffic (metadata included) once they complete
    assert_all(comm, st == want, f"{st} != {want}")
    assert_all(comm, out.info["stats"] == ref.info["stats"], f"{out.info} != {ref.info}")
    if comm.size > 1:
        assert_all(comm, st.bytes_sent > 0)


@pytest.mark.parametrize("name", ["allgather", "gtopk"])
def test_bad_input_raises_everywhere_through_wait(comm, name):
    bad = comm.size - 1
    vals, idx = _input(comm.rank, 1)
    if comm.rank == bad:
        idx = idx.copy()
        idx[3] = N + 5
    req = sparsecoll.iallreduce(comm, vals, idx, n=N, algorithm=name, **_opts(name))
    try:
        req.wait()
        got = None
    except sparsecoll.CollectiveInputError as exc:
        got = str(exc)
    assert_all(comm, got is not None and "out of range" in got and f"rank {bad}" in got, got)
    assert_all(comm, len(set(comm.allgather_object(got))) == 1)
    assert_all(comm, req.done() and isinstance(req.exception(), ValueError))
    # the engine goes on
    out = sparsecoll.iallreduce(comm, *_input(comm.rank, 2), n=N).wait()
    assert_all(comm, out.n == N)


def test_many_requests_waited_in_any_order_or_dropped(comm):
    """120 requests outstanding at once (three algorithms), each rank completing them in its
    own random order (by wait, by a test() loop, or after a wait(timeout=0) that may time
    out), and a quarter dropped without a wait: every completed one has the blocking
    result, and the communicator goes on (the dropped ones still ran, in order)."""
    names = ["allgather", "dsa", "gtopk"]
    inputs = [_input(comm.rank, seed) for seed in range(3)]
    want = {
        (name, seed): digest(sparsecoll.allreduce(comm, v, i, n=N, algorithm=name, **_opts(name)))
        for name in names
        for seed, (v, i) in enumerate(inputs)
    }
    keys = [(names[j % 3], (j // 3) % 3) for j in range(120)]
    reqs = [
        sparsecoll.iallreduce(comm, *inputs[seed], n=N, algorithm=name, **_opts(name))
        for name, seed in keys
    ]
    rng = np.random.default_rng(comm.rank)  # (each rank its own order)
    bad = []
    for pos, j in enumerate(rng.permutation(120)):
        if j % 4 == 3:
            reqs[j] = None  # dropped
            continue
        if pos % 3 == 0:
            while not reqs[j].test():
                time.sleep(0.001)
        elif pos % 3 == 1:
            with contextlib.suppress(TimeoutError):
                reqs[j].wait(timeout=0)
        if digest(reqs[j].wait(timeout=120)) != want[keys[j]]:
            bad.append(j)
    del reqs
    gc.collect()
    after = sparsecoll.allreduce(comm, *inputs[0], n=N)
    assert_all(comm, not bad, f"requests {bad} differ from the blocking results")
    assert_all(comm, digest(after) == want[("allgather", 0)], "the call after them differs")


def _steps(comm, name: str, seed: int, n: int, steps: int):
    """Gradients, and a reducer's blocking updates of them, made with the MPI calls the
    progress thread makes (a library's blocking and nonblocking allreduce may add in
    different orders: Open MPI 5.0's do)."""
    grads = [
        np.random.default_rng([seed, comm.rank, t]).standard_normal(n).astype(np.float32)
        for t in range(steps)
    ]
    same_calls = sparsecoll.Communicator(comm.mpi_comm, poll=comm.engine().comm.poll)
    sync = GradientReducer(same_calls, n, name, 0.05, warmup=1)
    return grads, sync, [sync.step(g) for g in grads]


@pytest.mark.parametrize("name", NAMES)
def test_step_async_equals_step(comm, name):
    n, steps = 2000, 4
    grads, sync, want = _steps(comm, name, 9, n, steps)
    red = GradientReducer(comm, n, name, 0.05, warmup=1)
    reqs = [red.step_async(g) for g in grads]  # all outstanding at once
    got = [r.wait() for r in reqs]
    same = all(np.array_equal(a, b) for a, b in zip(got, want))
    assert_all(comm, same, f"{name}: step_async updates differ from step's")
    assert_all(comm, np.array_equal(red.residual, sync.residual) and red.steps == steps)
    assert_all(comm, red.stats()["bytes_sent_total"] == sync.stats()["bytes_sent_total"])


@pytest.mark.parametrize("name", ["allgather", "exdyna"])
def test_reused_update_of_step_async_outlives_later_submissions(comm, name):
    """reuse_update: a step's update is the reducer's own buffer, valid until the next
    step. step_async submitted steps before the earlier ones' updates were waited for, and
    every step wrote the one buffer: three steps outstanding gave the third's update three
    times. A step submitted (or a blocking one made) while an update is not yet handed over
    by wait() gets an array of its own; once it is, the buffer is reused again."""
    n = 2000
    grads, sync, want = _steps(comm, name, 11, n, 6)
    # (its blocking step below: with the MPI calls of the progress thread, as _steps's)
    red = GradientReducer(sync.comm, n, name, 0.05, warmup=1, reuse_update=True)
    reqs = [red.step_async(g) for g in grads[:3]]  # outstanding at once
    reqs[-1].wait()  # (all three have completed: the updates are read after the last)
    got = [r.wait().copy() for r in reqs]
    first = reqs[0].wait()
    later = red.step_async(grads[3]).wait()  # after every update was handed over
    got.append(later.copy())
    reused = np.shares_memory(first, later)
    pending = red.step_async(grads[4])
    got.append(red.step(grads[5], out=None).copy())  # blocking, the update above not taken
    got.insert(4, pending.wait().copy())
    same = [bool(np.array_equal(a, b)) for a, b in zip(got, want)]
    assert_all(comm, all(same), f"{name}: updates equal to step's: {same}")
    assert_all(comm, reused, "the buffer was not reused once its update was handed over")


def test_step_async_with_reuse_update_does_not_wait_for_the_step_before(comm):
    """step_async returns at once with an earlier step_async still pending, reuse_update or
    not: it asked the earlier request for its exception(), which waits for the call, so each
    submission waited for the step before it (for the other ranks to reach it), and with
    the queue held by this rank (here a local gate that this thread opens after
    submitting) for ever."""
    n = 500
    g = np.random.default_rng([5, comm.rank]).standard_normal(n).astype(np.float32)
    red = GradientReducer(comm, n, "allgather", 0.05, reuse_update=True)
    gate = threading.Event()
    opener = threading.Timer(20, gate.set)  # (without the fix: opens the gate, ends the wait)
    opener.start()
    try:
        blocker = comm.engine().submit(gate.wait, "gate")  # holds the queue (local)
        first = red.step_async(g)
        second = red.step_async(g)
        returned = not gate.is_set()
    finally:
        gate.set()
        opener.cancel()
    assert blocker.wait() is True
    a, b = first.wait(), second.wait()
    assert_all(comm, returned, "step_async waited for the pending step before it")
    assert_all(comm, not np.shares_memory(a, b), "two pending steps wrote one update buffer")


def test_wait_timeout_leaves_the_request_running(comm):
    engine = comm.engine()
    gate = threading.Event()
    blocker = engine.submit(gate.wait, "gate")  # holds the queue (local, no communication)
    req = sparsecoll.iallreduce(comm, *_input(comm.rank, 3), n=N)
    with pytest.raises(TimeoutError, match="did not complete within"):
        req.wait(timeout=0.05)
    assert not req.test() and not req.done()
    with comm.measure() as st:  # measuring does not wait for pending requests
        pass
    assert st == sparsecoll.CommStats()
    gate.set()
    assert blocker.wait() is True
    out = req.wait(timeout=600)
    assert_all(comm, digest(out) == digest(sparsecoll.allreduce(comm, *_input(comm.rank, 3), n=N)))


def test_a_completed_request_is_no_longer_pending(comm):
    """Whoever sees a request done sees the engine count it as completed (``pending()``,
    which the exit handler reads to decide on MPI_Abort). The request was marked done
    before the engine counted it, so in between it was both done and pending."""
    engine = comm.engine()
    started, go = threading.Event(), threading.Event()

    def call():  # local, no communication
        started.set()
        go.wait()
        return 1

    req = engine.submit(call, "local")
    started.wait()
    with engine._cond:  # the engine cannot count the call while this is held
        go.set()
        time.sleep(0.2)  # the call returns meanwhile
        both = req.test() and engine.pending() > 0
    assert req.wait() == 1
    assert not both, "the request was done while the engine still counted it pending"


@pytest.mark.parametrize("setting", ["soon", "-1", "nan"])
def test_bad_timeout_setting_queues_nothing(comm, monkeypatch, setting):
    """A SPARSECOLL_TIMEOUT that is not a number >= 0 raises from submit before the call is
    queued (it was queued, and ran, while the caller got the ValueError and no request);
    the message says what is allowed (for "-1" it said "must be a number")."""
    from sparsecoll import _timeout

    engine = comm.engine()
    ran = threading.Event()
    before = engine.pending(), engine._submitted
    monkeypatch.setenv("SPARSECOLL_TIMEOUT", setting)
    monkeypatch.setattr(_timeout, "_timeout_read", False)
    want = f"SPARSECOLL_TIMEOUT must be a number of seconds >= 0 .*, got '{setting}'"
    with pytest.raises(ValueError, match=want):
        engine.submit(ran.set, "local")
    engine.drain()
    assert not ran.is_set(), "the call ran although submit raised"
    assert (engine.pending(), engine._submitted) == before


def test_wait_timeout_while_other_ranks_are_late(comm):
    if comm.size == 1:
        pytest.skip("needs a rank that is late")
    vals, idx = _input(comm.rank, 4)
    if comm.rank == 0:
        req = sparsecoll.iallreduce(comm, vals, idx, n=N)
        with pytest.raises(TimeoutError):
            req.wait(timeout=0.05)  # the others have not started it yet
        comm.mpi_comm.Barrier()  # raw MPI: a sparsecoll call would wait for req first
    else:
        comm.mpi_comm.Barrier()
        req = sparsecoll.iallreduce(comm, vals, idx, n=N)
    out = req.wait()
    assert_all(comm, digest(out) == digest(sparsecoll.allreduce(comm, vals, idx, n=N)))


def test_freeing_the_communicator_with_requests_pending(comm):
    """MPI_Comm_free with requests pending: they still complete (on the engine's duplicate),
    and the engine then frees its two duplicates, so communicators used for nonblocking calls
    and freed do not use up MPI's context ids (MPICH has 2048: ~1000 such cycles failed)."""
    from mpi4py import MPI

    inputs = [_input(comm.rank, seed) for seed in range(3)]
    want = [digest(sparsecoll.allreduce(comm, v, i, n=N)) for v, i in inputs]
    mine = comm.mpi_comm.Dup()
    engine = sparsecoll.Communicator(mine).engine()
    reqs = [sparsecoll.iallreduce(mine, v, i, n=N) for v, i in inputs]
    mine.Free()
    got = []
    for r in reqs:
        try:
            got.append(digest(r.wait(timeout=120)))
        except Exception as exc:
            got.append(f"{type(exc).__name__}: {exc}")
    assert_all(comm, got == want, f"requests pending at MPI_Comm_free: {got}")
    engine._thread.join(timeout=120)
    assert_all(comm, not engine._thread.is_alive(), "the engine's thread did not end")
    freed = engine.comm.mpi_comm == MPI.COMM_NULL and engine._alarm.mpi_comm == MPI.COMM_NULL
    assert_all(comm, freed, "the engine's duplicates were not freed")
    for _ in range(20):  # and again, each cycle leaving nothing behind
        mine = comm.mpi_comm.Dup()
        out = sparsecoll.iallreduce(mine, *inputs[0], n=N).wait(timeout=120)
        mine.Free()
    assert_all(comm, digest(out) == want[0])


def test_interrupt_as_a_watched_call_starts_leaves_nothing_watched(comm, monkeypatch):
    """A KeyboardInterrupt (Ctrl-C) as a blocking call registers with the watchdog (while
    the watchdog's thread starts, made to raise here): the call stayed registered as
    running, so a program that catches the interrupt and goes on (to save a checkpoint, say)
    had its job aborted by the watchdog one timeout later, in a call no longer running."""
    from sparsecoll import _progress

    mine = comm.mpi_comm.Dup()  # a new engine: its watchdog has not started
    c = sparsecoll.Communicator(mine)
    engine = c.engine()
    vals, idx = _input(comm.rank, 5)

    def interrupted(self):
        raise KeyboardInterrupt

    before = sparsecoll.get_timeout()
    sparsecoll.set_timeout(600)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(_progress.Engine, "_start_watchdog", interrupted)
            with pytest.raises(KeyboardInterrupt):
                sparsecoll.allreduce(c, vals, idx, n=N)
        state = engine.state()
        out = sparsecoll.allreduce(c, vals, idx, n=N)  # watched, as usual
    finally:
        sparsecoll.set_timeout(before)
    assert_all(comm, not engine._blocking and state.startswith("idle"), state)
    assert_all(comm, digest(out) == digest(sparsecoll.allreduce(comm, vals, idx, n=N)))
    mine.Free()


class _Subclass(sparsecoll.Communicator):
    """A Communicator subclass, as NCCLCommunicator is (no progress engine)."""


def test_watchdog_with_a_communicator_subclass(comm):
    """With the watchdog on, blocking allreduce is watched by the progress engine, which a
    subclass (NCCLCommunicator) has not: it must run as without the watchdog, not raise
    NotImplementedError."""
    vals, idx = _input(comm.rank, 6)
    want = digest(sparsecoll.allreduce(comm, vals, idx, n=N))
    sub = _Subclass(comm.mpi_comm)
    before = sparsecoll.get_timeout()
    sparsecoll.set_timeout(600)
    try:
        got = digest(sparsecoll.allreduce(sub, vals, idx, n=N))
    except NotImplementedError as exc:
        got = str(exc)
    finally:
        sparsecoll.set_timeout(before)
    assert_all(comm, got == want, f"allreduce on a subclass with the watchdog on: {got}")


def test_communicator_methods_called_directly_are_watched(comm):
    """With the watchdog on, the Communicator's methods called directly are watched
    blocking calls, numbered as such (a rank skipping one aborted nothing: the others
    waited for ever). A collective one starts the engine (the first call here), one inside
    another (alltoallv's counts exchange) is part of it, a point-to-point one is watched
    once an engine runs and starts none: ranks 0 and 1 alone exchange on a communicator
    without one (an engine's start is collective: the other ranks would never join it)."""
    mine, pair = (sparsecoll.Communicator(comm.mpi_comm.Dup()) for _ in range(2))
    size, right, left = mine.size, (mine.rank + 1) % mine.size, (mine.rank - 1) % mine.size
    before = sparsecoll.get_timeout()
    sparsecoll.set_timeout(600)
    try:
        gathered, _ = mine.allgatherv(np.full(2, mine.rank, np.int64))
        mine.barrier()
        got = [gathered.tolist(), mine.sendrecv_ints(mine.rank, right, left)]
        states = [mine.engine().state()]
        got.append(mine.alltoallv(np.arange(size, dtype=np.float32), [1] * size)[0].tolist())
        states.append(mine.engine().state())
        if size > 1 and mine.rank < 2:
            other, buf = 1 - pair.rank, np.empty(3, np.float32)
            pair.sendrecv(np.full(3, pair.rank, np.float32), other, buf, other)
            got.append(buf.tolist())
        no_engine = pair._attached_engine() is None
    finally:
        sparsecoll.set_timeout(before)
    want = [[r for r in range(size) for _ in range(2)], left]
    want.append([float(mine.rank)] * size)
    if size > 1 and mine.rank < 2:
        want.append([float(1 - mine.rank)] * 3)
    assert_all(comm, got == want, f"results {got}, expected {want}")
    expected = [
        "idle after call #3 Communicator.sendrecv_ints() (3 started, 3 completed)",
        "idle after call #4 Communicator.alltoallv() (4 started, 4 completed)",
    ]
    assert_all(comm, states == expected, f"engine states {states}")
    assert_all(comm, no_engine, "a point-to-point call started a progress engine")
    mine.mpi_comm.Free()
    pair.mpi_comm.Free()


@pytest.mark.parametrize("call", ["state_dict", "reset"])
def test_reducer_state_calls_wait_for_pending_steps(comm, call):
    """state_dict() and reset() wait for pending step_async calls, as step() does: a state
    saved while a step was queued was the state before it (saved, steps == 0), and a reset
    was undone by the step that ran after it (steps == 1, a residual)."""
    n = 2000
    g = np.random.default_rng([4, comm.rank]).standard_normal(n)
    red = GradientReducer(comm, n, "allgather", 0.05)
    twin = GradientReducer(comm, n, "allgather", 0.05)
    twin.step(g)
    gate = threading.Event()
    blocker = comm.engine().submit(gate.wait, "gate")  # holds the queue (local)
    req = red.step_async(g)
    threading.Timer(0.2, gate.set).start()
    if call == "state_dict":
        state = red.state_dict()
        ok = state["steps"] == 1 and np.array_equal(state["residual"], twin.residual)
    else:
        red.reset()
        ok = True
    assert blocker.wait() is True
    req.wait()
    if call == "reset":
        ok = red.steps == 0 and red.residual is None
    assert_all(comm, ok, f"{call} did not wait for the pending step")


def _in_threads(comm, *targets, timeout=120.0):
    """Run ``targets`` in threads started together; their errors, or a diagnostic and
    MPI_Abort when one is stuck (a hang must fail the test, not block the job)."""
    errors: list[str] = []
    start = threading.Barrier(len(targets))

    def run(fn):
        try:
            start.wait()
            fn()
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(fn,), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        print(f"rank {comm.rank}: threads still in their calls after {timeout} s", flush=True)
        comm.abort(1)
    return errors


def test_blocking_calls_from_two_threads_at_once(comm):
    """Two threads in blocking calls on one communicator at once, with the same input (so
    their order cannot change the result): each rank runs them one at a time. Without that
    they interleaved their MPI messages: MPICH aborted with "Message truncated" (P = 3)."""
    from mpi4py import MPI

    mine = sparsecoll.Communicator(MPI.COMM_WORLD.Dup())
    vals, idx = _input(comm.rank, 7)
    want = digest(sparsecoll.allreduce(comm, vals, idx, n=N))
    red = [GradientReducer(mine, N, "allgather", 0.05) for _ in range(2)]
    twin = GradientReducer(comm, N, "allgather", 0.05)
    grad = np.random.default_rng([7, comm.rank]).standard_normal(N)
    step_want = twin.step(grad)
    got: list[object] = []

    def calls():
        for _ in range(10):
            got.append(digest(sparsecoll.allreduce(mine, vals, idx, n=N)))

    def step(i):
        return lambda: got.append(np.array_equal(red[i].step(grad), step_want))

    errors = _in_threads(comm, calls, calls) + _in_threads(comm, step(0), step(1))
    assert_all(comm, not errors, errors)
    assert_all(comm, got.count(want) == 20 and got.count(True) == 2, "wrong results")
    mine.mpi_comm.Free()


def test_watchdog_keeps_blocking_calls_apart_from_nonblocking_ones(comm):
    """One thread in blocking reducer steps and allreduces, another in iallreduce calls (of
    another n), on one communicator, with the watchdog on: the blocking calls run on the
    user's communicator as without the watchdog (watched where they run), the nonblocking
    ones on the progress thread's duplicate, so no rank pairs one kind with the other.
    When the watchdog queued the blocking calls behind the other thread's, their order
    differed between ranks: about 12 of 30 calls a thread failed (P = 2)."""
    vals, idx = _input(comm.rank, 9)
    want = digest(sparsecoll.allreduce(comm, vals, idx, n=N))
    small = np.ones(3, np.float32), np.array([0, 1, 2])
    red = GradientReducer(comm, N, "allgather", 0.05)
    twin = GradientReducer(comm, N, "allgather", 0.05)
    grad = np.random.default_rng([9, comm.rank]).standard_normal(N)
    step_want = [twin.step(grad) for _ in range(10)]
    rng = np.random.default_rng(comm.rank)  # different timings on each rank
    got: list[object] = []

    def blocking():
        for t in range(10):
            time.sleep(rng.random() * 0.003)
            got.append(np.array_equal(red.step(grad), step_want[t]))
            got.append(digest(sparsecoll.allreduce(comm, vals, idx, n=N)))

    def nonblocking():
        for _ in range(20):
            time.sleep(rng.random() * 0.003)
            got.append(sparsecoll.iallreduce(comm, *small, n=10).wait().values.tolist())

    before = sparsecoll.get_timeout()
    sparsecoll.set_timeout(600)
    try:
        errors = _in_threads(comm, blocking, nonblocking)
    finally:
        sparsecoll.set_timeout(before)
    assert_all(comm, not errors, errors)
    p = float(comm.size)
    ok = got.count(True) == 10 and got.count(want) == 10 and got.count([p, p, p]) == 20
    assert_all(comm, ok, "wrong results")


def test_first_nonblocking_calls_from_two_threads_at_once(comm):
    """Two threads making the first nonblocking call on a communicator at once (same input):
    one progress engine starts. Both started one, each duplicating the communicator twice
    at the same time as the other: MPICH aborted ("Message truncated" in MPI_Comm_dup)."""
    from mpi4py import MPI

    vals, idx = _input(comm.rank, 8)
    want = digest(sparsecoll.allreduce(comm, vals, idx, n=N))
    for _ in range(3):
        mine = MPI.COMM_WORLD.Dup()
        reqs: list[sparsecoll.SparseRequest] = []

        def submit(mine=mine, reqs=reqs):
            reqs.append(sparsecoll.iallreduce(mine, vals, idx, n=N))

        errors = _in_threads(comm, submit, submit)
        assert_all(comm, not errors, errors)
        got = [digest(r.wait(timeout=120)) for r in reqs]
        engine = sparsecoll.Communicator(mine).engine()
        assert_all(comm, got == [want, want] and engine.pending() == 0, "wrong results")
        assert_all(comm, engine._submitted == 2, "the calls went to different engines")
        mine.Free()


def test_the_progress_thread_keeps_nothing_of_a_completed_call(comm):
    """Once a request has completed and the caller has dropped it, its result and its
    arguments are freed. The progress thread kept the last call's request (holding the
    result, e.g. step_async's dense update) and function (holding the gradient) alive until
    the next call."""
    engine = comm.engine()

    class Big:  # stands for a gradient and an update
        pass

    arg, result = Big(), Big()
    refs = [weakref.ref(arg), weakref.ref(result)]
    req = engine.submit(lambda arg=arg, out=result: out, "local")
    assert req.wait(timeout=120) is result
    del req, arg, result
    for _ in range(200):  # the thread may still be finishing the call: give it 2 s
        gc.collect()
        if all(r() is None for r in refs):
            break
        time.sleep(0.01)
    assert [r() is None for r in refs] == [True, True], "still alive after the call"


def _blocking_call(kind: str, c):
    """A blocking call of ``kind`` on ``c`` (what came before it, such as the hook's dense
    warm-up iteration before its sparse one, done here): returns a function that makes it
    and returns the stats it reports."""
    rng = np.random.default_rng([11, c.rank])
    if kind == "allreduce":
        vals, idx = _input(c.rank, 8)

        def call():  # (dsa measures its phases inside allreduce's measure)
            info = sparsecoll.allreduce(c, vals, idx, n=N, algorithm="dsa").info
            phases = {k: v.as_dict() for k, v in info["phases"].items()}
            return {"info": info["stats"], "last_stats": c.last_stats, "phases": phases}

        return call
    if kind == "step":
        red = GradientReducer(c, N, "allgather", density=0.02)
        grad = rng.standard_normal(N).astype(np.float32)

        def step():
            red.step(grad)
            return {k: v for k, v in red.stats().items() if "bytes" in k}

        return step
    torch = pytest.importorskip("torch")
    from sparsecoll.integrations.torch import SparseHookState, sparse_allreduce_hook

    state = SparseHookState(c, "allgather", density=0.02)
    grads = [torch.from_numpy(rng.standard_normal(N).astype(np.float32)) for _ in range(2)]

    def hook(grad):
        sparse_allreduce_hook(state, _Bucket(grad)).wait()
        return {k: v for k, v in state.stats().items() if "bytes" in k}

    if kind == "hook step":
        hook(grads[0])  # the dense warm-up iteration: the next one steps its reducer
    return lambda: hook(grads[1])


class _Bucket:
    """A stand-in for DDP's only bucket (of one model: the same parameter every time)."""

    PARAMETERS = (np.zeros(0),)

    def __init__(self, buf):
        self.buf = buf

    def buffer(self):
        return self.buf

    def index(self):
        return 0

    def is_last(self):
        return True

    def parameters(self):
        return self.PARAMETERS


@contextlib.contextmanager
def _request_inside_measure(c, submit):
    """Make a request of another thread complete inside ``c``'s next measure() scope, as
    it may by chance: the scope opens, the thread calls ``submit(c)`` (which submits a
    request), and only then does the scope's first call run (which first waits for the
    pending request). Yields a dict that gets the request's result."""
    inside, submitted = threading.Event(), threading.Event()
    measure = c.measure

    @contextlib.contextmanager
    def first_measure():
        del c.measure  # (the scopes nested in it measure as ever)
        with measure() as st:
            inside.set()
            submitted.wait(120)
            yield st

    def other():
        if inside.wait(120):
            req = submit(c)
            submitted.set()
            got["value"] = req.wait(120)

    got: dict = {}
    c.measure = first_measure
    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    try:
        yield got
    finally:
        inside.set()
        thread.join(120)


@pytest.mark.parametrize("kind", ["allreduce", "step", "hook warm-up", "hook step"])
def test_stats_leave_out_another_threads_request(comm, kind):
    """A blocking call's stats count its own traffic only, not that of a request another
    thread submitted meanwhile (which its first call waits for): the allreduce's
    info["stats"] and last_stats (and dsa's phases), GradientReducer.stats() and
    SparseHookState.stats() read the sum of both. The
    Communicator's totals count both, the request's own info["stats"] its own."""
    big = _input(comm.rank, 9, 10 * K)  # (a request moving more bytes)

    def submit(c):
        return sparsecoll.iallreduce(c, *big, n=N)

    alone = sparsecoll.Communicator(comm.mpi_comm)
    call = _blocking_call(kind, alone)
    before = alone.stats.copy()
    want = call()
    want_request = submit(alone).wait(120).info["stats"]
    want_total = alone.stats - before

    c = sparsecoll.Communicator(comm.mpi_comm)
    call = _blocking_call(kind, c)
    before = c.stats.copy()
    with _request_inside_measure(c, submit) as request:
        got = call()
    assert_all(comm, "value" in request, "the request did not complete")
    got_request = request["value"].info["stats"]
    assert_all(comm, got == want, f"{kind}: {got} != {want} (alone)")
    assert_all(comm, got_request == want_request, f"{got_request} != {want_request}")
    total = c.stats - before
    assert_all(comm, total == want_total, f"the totals count {total}, not {want_total}")


def test_wait_on_the_progress_thread_raises_instead_of_hanging(comm):
    """A callable run on the progress thread (as a callback of the DDP hook's future is)
    that waits for a request not yet complete, or drains the engine, raises RuntimeError
    on every rank: only that thread completes requests, so it waited for ever (the job
    hung). Waiting there for a request already complete still returns its result."""
    vals, idx = _input(comm.rank, 12)
    c = sparsecoll.Communicator(comm.mpi_comm)
    engine = c.engine()
    first = sparsecoll.iallreduce(c, vals, idx, n=N)
    later: list = []

    def on_the_thread():
        got = [digest(first.wait())]  # complete (submitted before): returns
        # (with timeouts, and no drain() if they time out: it had none, and hung the job)
        for wait in (later[0].wait, later[0].result, engine.drain):
            try:
                wait() if wait == engine.drain else wait(timeout=10)
                got.append("returned")
            except Exception as exc:
                got.append(f"{type(exc).__name__}: {exc}")
                if type(exc) is not RuntimeError:
                    break
        return got

    req = engine.submit(on_the_thread, "waits on the progress thread", owner=c)
    later.append(sparsecoll.iallreduce(c, vals, idx, n=N))
    got = req.wait(timeout=120)
    want = digest(sparsecoll.allreduce(c, vals, idx, n=N))
    assert_all(comm, got[0] == want, f"the completed request: {got[0]}")
    pending = f"(call #{later[0].call}), not complete, from the progress thread that runs it"
    ok = len(got) == 4 and pending in got[1] and pending in got[2]
    ok = ok and got[3].startswith("RuntimeError: drain() on the progress thread")
    assert_all(comm, ok, f"waits on the progress thread: {got[1:]}")
    assert_all(comm, digest(later[0].wait(timeout=120)) == want)


def test_last_stats_is_the_calling_threads_last_call(comm):
    """last_stats is per thread: after a request completed (on the progress thread, which
    runs allreduce on the same Communicator), the thread still reads its own last blocking
    call's stats, not the request's; a thread that made no call reads empty stats."""
    c = sparsecoll.Communicator(comm.mpi_comm)
    small, big = _input(comm.rank, 13, 2), _input(comm.rank, 14, 10 * K)
    mine = sparsecoll.allreduce(c, *small, n=N).info["stats"]
    request = sparsecoll.iallreduce(c, *big, n=N).wait(timeout=120).info["stats"]
    seen: list = []
    thread = threading.Thread(target=lambda: seen.append(c.last_stats))
    thread.start()
    thread.join(120)
    same = c.last_stats == mine and c.last_stats is not request
    assert_all(comm, same, f"last_stats {c.last_stats} (own call {mine}, request {request})")
    assert_all(comm, seen == [sparsecoll.CommStats()], f"another thread's: {seen}")


def _first_call(kind: str, c, blocking: bool):
    """The first call of ``kind`` on ``c``: blocking, or its nonblocking twin waited for."""
    v, i = _input(c.rank, 7)
    if kind == "allreduce":
        if blocking:
            return sparsecoll.allreduce(c, v, i, n=N)
        return sparsecoll.iallreduce(c, v, i, n=N).wait()
    red = GradientReducer(c, N, "allgather", 0.05)
    g = np.zeros(N, np.float32)
    g[i] = v
    return red.step(g) if blocking else red.step_async(g).wait()


@pytest.mark.parametrize("watched", [False, True])
@pytest.mark.parametrize("kind", ["allreduce", "step"])
def test_a_blocking_call_against_a_first_nonblocking_one_raises_everywhere(comm, kind, watched):
    """Rank 0 makes a blocking call where the others make their first nonblocking call on
    the communicator (a user's error): every rank raises the same CollectiveInputError
    naming both calls (the nonblocking call's engine start duplicated the communicator,
    colliding with rank 0's input agreement: MPICH aborted with "Message truncated"; with
    the watchdog both started an engine, then waited on different communicators until it
    fired). Nothing is left started: the same calls on every rank then work."""
    from mpi4py import MPI

    if comm.size < 2:
        pytest.skip("needs two ranks")
    before = sparsecoll.get_timeout()
    sparsecoll.set_timeout(600 if watched else None)
    mine = sparsecoll.Communicator(MPI.COMM_WORLD.Dup())  # (no engine yet)
    try:
        with pytest.raises(sparsecoll.CollectiveInputError) as info:
            _first_call(kind, mine, blocking=comm.rank == 0)
        msg = str(info.value)
        assert_all(comm, len(set(comm.allgather_object(msg))) == 1, msg)
        others = "rank 1" if comm.size == 2 else f"ranks {', '.join(map(str, range(1, comm.size)))}"
        label = "allreduce(algorithm='allgather', n=3000)" if kind == "allreduce" else "step"
        assert_all(comm, "blocking and nonblocking calls mixed" in msg, msg)
        assert_all(comm, f"rank 0: a blocking call ({label}" in msg, msg)
        assert_all(
            comm,
            f"{others}: a nonblocking call (i{label}" in msg
            or f"{others}: a nonblocking call ({label}_async" in msg,
            msg,
        )
        got = _first_call(kind, mine, blocking=False)  # (the engine starts now, everywhere)
        want = _first_call(kind, mine, blocking=True)
        same = digest(got) == digest(want) if kind == "allreduce" else np.allclose(got, want)
        assert_all(comm, same, "the calls after the error give other results")
    finally:
        sparsecoll.set_timeout(before)
        mine.mpi_comm.Free()


@pytest.mark.parametrize("kind", ["allreduce", "step"])
def test_the_watchdog_on_some_ranks_only_is_named(comm, kind):
    """The watchdog set on rank 0 alone (sparsecoll.set_timeout or SPARSECOLL_TIMEOUT must be
    alike on every rank): its first blocking call starts the engine where the others make
    their input agreement. Every rank raised "blocking and nonblocking calls mixed on this
    communicator (ranks 0, 1: a blocking call (...))", at every call, about calls that were
    all blocking; now the message says what differs. Once set alike, the calls work."""
    from mpi4py import MPI

    if comm.size < 2:
        pytest.skip("needs two ranks")
    before = sparsecoll.get_timeout()
    mine = sparsecoll.Communicator(MPI.COMM_WORLD.Dup())  # (no engine yet)
    try:
        sparsecoll.set_timeout(600 if comm.rank == 0 else None)
        try:
            with pytest.raises(sparsecoll.CollectiveInputError) as info:
                _first_call(kind, mine, blocking=True)
        finally:
            # (alike again before the checks: rank 0's watched allgather in assert_all would
            # start an engine on comm against the others' plain allgather, and hang)
            sparsecoll.set_timeout(None)
        msg = str(info.value)
        assert_all(comm, len(set(comm.allgather_object(msg))) == 1, msg)
        others = "rank 1" if comm.size == 2 else f"ranks {', '.join(map(str, range(1, comm.size)))}"
        assert_all(comm, msg.startswith(f"the watchdog is on on rank 0 but off on {others} ("), msg)
        sparsecoll.set_timeout(600)
        got = _first_call(kind, mine, blocking=True)
        sparsecoll.set_timeout(None)
        want = _first_call(kind, mine, blocking=True)
        same = digest(got) == digest(want) if kind == "allreduce" else np.allclose(got, want)
        assert_all(comm, same, "the calls after the error give other results")
    finally:
        sparsecoll.set_timeout(before)
        mine.mpi_comm.Free()


@pytest.mark.parametrize("watched", [False, True])
def test_the_first_nonblocking_call_returns_at_once(comm, watched):
    """The first iallreduce on a communicator starts its progress engine (a collective
    start) without waiting for the other ranks: rank 0's calls return while the others are
    still DELAY s away from theirs, and so do the calls after it; the results equal
    allreduce's. (Each rank's limit is a quarter of the delay: timing on a loaded machine
    is noisy, and the target, under 50 ms, is far below it.)"""
    from mpi4py import MPI

    delay = 2.0
    inputs = [_input(comm.rank, seed) for seed in range(3)]
    names = ("allgather", "oktopk", "allgather")
    opts = [_opts(name) for name in names]
    want = [
        digest(sparsecoll.allreduce(comm, v, i, n=N, algorithm=name, **o))
        for (v, i), name, o in zip(inputs, names, opts)
    ]
    before = sparsecoll.get_timeout()
    mine = sparsecoll.Communicator(MPI.COMM_WORLD.Dup())  # (no engine yet)
    try:
        sparsecoll.set_timeout(600 if watched else None)
        comm.barrier()
        if comm.rank > 0:
            time.sleep(delay)
        took, reqs = [], []
        for (v, i), name, o in zip(inputs, names, opts):
            start = time.perf_counter()
            reqs.append(sparsecoll.iallreduce(mine, v, i, n=N, algorithm=name, **o))
            took.append(time.perf_counter() - start)
        got = [digest(r.wait(timeout=120)) for r in reqs]
    finally:
        sparsecoll.set_timeout(before)
    assert_all(comm, max(took) < delay / 4, f"iallreduce calls took {took} s")
    assert_all(comm, got == want, "iallreduce differs from allreduce")
    mine.mpi_comm.Free()
