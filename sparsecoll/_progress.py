"""Nonblocking calls: a progress thread per communicator, requests, and the watchdog.

Each MPI communicator used for nonblocking calls gets one :class:`Engine` (see
:meth:`sparsecoll.Communicator.engine`): a daemon thread that first completes the engine's
collective start, then runs the submitted calls one after the other, in submission order,
on a duplicate of the communicator in polling mode (so neither the user's own traffic can
interleave with it nor its waiting spin a core). Every rank must submit its calls in the
same order, as with blocking collectives. It imports only :mod:`._timeout` of sparsecoll's.

The watchdog (off by default; :func:`set_timeout` or ``SPARSECOLL_TIMEOUT=seconds``) watches
the call each engine is running, and the blocking calls the user's threads make on the
communicator (:meth:`Engine.watching`, where they run): past the timeout it prints this
rank's state to stderr, asks every other rank (a small message on a second duplicate, never
a collective) to print theirs and to answer with it, and after a short grace period prints
which ranks are in that call, which in another (or idle), and which did not answer (exited,
in MPI_Finalize, or their watchdog stopped), then calls MPI_Abort.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ._timeout import _seconds, limit

__all__ = [
    "Engine",
    "SparseRequest",
    "shutdown",
    "starting",
    "stop",
]

ALARM_TAG = 0x5C7  # tag of the watchdog's messages, on the engine's own duplicate
ANSWER_TAG = 0x5C8  # tag of the answers to them: each rank's state
WATCH_PERIOD = 0.05  # seconds between two looks of the watchdog
GRACE = 1.0  # seconds the other ranks get to print their state before MPI_Abort

_engines: weakref.WeakSet[Engine] = weakref.WeakSet()
_atexit_registered = False
_registry_lock = threading.Lock()


def _new_registry_lock() -> None:
    # (a fork while another thread holds the lock copies it locked: the child's own is free)
    global _registry_lock
    _registry_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_registry_lock)


@contextlib.contextmanager
def starting(comm: Any, call: str | None, own: tuple[float, str] | None = None) -> Iterator[None]:
    """Around the completion of ``comm``'s progress engine's collective start (its vote and
    duplications), which no engine watches yet: with the watchdog on (:func:`limit` of
    ``own``), past the timeout print this rank's state and call MPI_Abort (a rank that never
    makes the call that starts the engine would leave the others there for ever)."""
    watch = limit(own)
    if not watch:
        yield
        return
    timeout, source = watch

    def fire() -> None:
        _stderr(
            f"sparsecoll watchdog: rank {comm.rank} of {comm.size}: in the start of the "
            f"communicator's progress engine{f' (for {call})' if call else ''} for "
            f"{timeout:g} s, which every rank makes at its first nonblocking or watched "
            f"call there; some rank has not made it; timeout "
            f"{timeout:g} s expired ({source}); aborting the job"
        )
        time.sleep(GRACE)  # (so that mpiexec forwards the line before the abort ends the job)
        comm.abort(1)

    timer = threading.Timer(timeout, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


class SparseRequest:
    """A nonblocking call in flight, in the style of mpi4py requests and futures.

    ``wait()`` returns the call's result (a SparseVector for :func:`sparsecoll.iallreduce`,
    the dense update for ``GradientReducer.step_async``) or raises its error; ``test()`` and
    ``done()`` say whether it has completed, without waiting.
    """

    __slots__ = (
        "__weakref__",
        "_error",
        "_event",
        "_pid",
        "_taken",
        "_value",
        "_worker",
        "call",
        "label",
    )

    def __init__(self, call: int, label: str, worker: threading.Thread | None = None) -> None:
        self.call = call  # 1-based position among the engine's calls
        self.label = label
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._taken = False  # a wait() has returned the result (see GradientReducer.step_async)
        self._pid = os.getpid()  # (a child made by fork() would wait for ever)
        self._worker = worker  # the progress thread that completes it (None: not queued)

    def wait(self, timeout: float | None = None) -> Any:
        """Block (without spinning) until the call completes; return its result.

        ``timeout``: seconds at most (None: as long as it takes); 0 or less only looks
        whether the call has completed, as ``concurrent.futures.Future.result`` does.

        Raises:
            TimeoutError: not complete within ``timeout`` seconds; the call goes on, and a
                later ``wait()`` can still complete it.
            TypeError / ValueError: ``timeout`` is not None or a real number / is NaN.
            The call's own error (e.g. CollectiveInputError), on every rank alike.
            RuntimeError: in a child made by fork() while the call was pending in the
                parent; on the progress thread that runs the call, before it completed (in
                a callable run there, such as a DDP hook future's callback).
        """
        self._complete(timeout)
        if self._error is not None:
            raise self._error
        self._taken = True
        return self._value

    result = wait

    def test(self) -> bool:
        """Whether the call has completed (successfully or not); never waits."""
        return self._event.is_set()

    done = test

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The call's error, or None if it succeeded; as ``concurrent.futures.Future``, it
        first waits for the call to complete (``timeout``; TimeoutError, RuntimeError,
        TypeError, ValueError: as ``wait()``)."""
        self._complete(timeout)
        return self._error

    def _complete(self, timeout: Any) -> None:
        """Block until the call completes (the errors of ``wait()`` but the call's own)."""
        given, timeout = timeout, _seconds("timeout", timeout)
        if timeout is not None and timeout < 0:  # (as 0: concurrent.futures' convention)
            timeout = 0.0
        if not self._event.is_set() and threading.current_thread() is self._worker:
            raise RuntimeError(
                f"wait() on {self.label} (call #{self.call}), not complete, from the "
                f"progress thread that runs it: it would wait for ever; wait from another "
                f"thread, or only for requests that test() says are complete"
            )
        if not self._event.is_set() and os.getpid() != self._pid:
            raise RuntimeError(
                f"{self.label} (call #{self.call}) was pending in process {self._pid} when "
                f"process {os.getpid()} was forked from it: it completes in the parent only"
            )
        if not self._event.wait(timeout):
            raise TimeoutError(
                f"{self.label} (call #{self.call}) did not complete within {timeout:g} s"
                + ("" if given == timeout else f" (timeout={given!r}: 0 or less does not wait)")
            )

    def __repr__(self) -> str:
        state = "done" if self.test() else "pending"
        return f"<SparseRequest #{self.call} {self.label} {state}>"

    def _finish(self, value: Any, error: BaseException | None) -> None:
        self._value, self._error = value, error
        self._event.set()


class Engine:
    """One progress thread of the communicator of rank ``rank`` of ``size``: it first runs
    ``start()``, which completes the engine's collective start and returns its two
    Communicators, ``comm`` (a polling duplicate: the calls run there) and the watchdog's
    ``alarm``; then the submitted calls, in order. A start that raises fails every call
    submitted to the engine with its error (``failed``), and the engine ends. ``abort``
    ends the job while no alarm communicator exists. ``timeout``: the communicator's own
    (seconds, what sets it; see :func:`~._timeout.limit`).
    """

    def __init__(
        self,
        rank: int,
        size: int,
        start: Callable[[], tuple[Any, Any]],
        abort: Callable[[int], None],
        timeout: tuple[float, str] | None = None,
    ) -> None:
        self.rank, self.size, self.timeout = rank, size, timeout
        self._comm: Any = None
        self._alarm: Any = None
        self._start: Callable[[], tuple[Any, Any]] | None = start
        self._abort_job = abort
        self._ready = threading.Event()  # the start has ended (failed or not)
        self.failed: BaseException | None = None  # the start's error
        self._cond = threading.Condition()
        # (request, call, owner, the owner's measure() scopes open in the submitting thread)
        self._queue: deque[tuple[SparseRequest, Callable[[], Any], Any, Any]] = deque()
        self._submitted = 0
        self._completed = 0
        self._up = False  # the start has ended (as _ready, read where it costs little)
        self._closed = False
        self._current: SparseRequest | None = None
        self._started = 0.0
        # every call, queued or blocking (watching), numbered in the order this rank makes
        # them (the same on every rank): how many began, how many ended, the last to end
        self._calls = 0
        self._done = 0
        self._last = ""
        self._last_call = 0
        self._blocking: dict[int, tuple[SparseRequest, float]] = {}  # by thread: watching
        self._reported = False
        self._answers: list[Any] = []  # the watchdog's answers in flight (kept until abort)
        self._free = False  # free the duplicates when the thread ends (the user's comm was)
        self._ended = False  # the thread has left its loop
        self._stopped = False  # stop() ran (exit, MPI_Finalize): no more watchdog
        self._watchdog: threading.Thread | None = None
        self._pid = os.getpid()  # a child made by fork() has no progress thread
        self._thread = threading.Thread(
            target=self._loop, name=f"sparsecoll-progress-{rank}", daemon=True
        )
        self._thread.start()
        global _atexit_registered
        with _registry_lock:
            _engines.add(self)
            if not _atexit_registered:
                atexit.register(shutdown)
                _atexit_registered = True

    @property
    def comm(self) -> Any:
        """The Communicator the calls run on (waits for the start; raises its error)."""
        if self._comm is None:
            self.wait_started()
        return self._comm

    def wait_started(self) -> None:
        """Wait until the engine's start has completed; raise its error if it failed."""
        self._ready.wait()
        if self.failed is not None:
            raise self.failed

    # -- the user's side ------------------------------------------------------------------
    def submit(self, fn: Callable[[], Any], label: str, owner: Any = None) -> SparseRequest:
        """Queue ``fn`` (it calls collectives; every rank submits the same calls in the same
        order); its traffic is added to ``owner``'s stats (a Communicator) when it ends,
        and to the ``owner.measure()`` scopes the calling thread has open now, if still open
        then (not to another thread's: their calls moved none of it)."""
        self._check_process()
        watch = limit(self.timeout)  # (a bad SPARSECOLL_TIMEOUT raises here, before queuing)
        scopes = () if owner is None else tuple(owner._open_scopes())
        with self._cond:
            if self._closed:
                why = f": its start failed ({self.failed})" if self.failed else ""
                raise RuntimeError(f"the progress engine of this communicator is shut down{why}")
            self._submitted += 1
            self._calls += 1
            req = SparseRequest(self._calls, label, self._thread)
            self._queue.append((req, fn, owner, scopes))
            self._cond.notify_all()
        if self._watchdog is None and watch:
            self._start_watchdog()
        return req

    @contextlib.contextmanager
    def watching(self, label: str) -> Iterator[None]:
        """Let the watchdog see a blocking call that the calling thread makes where it runs,
        numbered among this engine's calls (a call inside a watched one is part of it). Its
        clock starts once the requests submitted before it have completed (it waits for
        them first, as its communication would): their time is theirs."""
        self._check_process()
        me = threading.get_ident()
        if me in self._blocking:
            yield
            return
        self.drain()
        try:  # (an interrupt while the watchdog starts leaves the call registered otherwise)
            with self._cond:
                self._calls += 1
                self._blocking[me] = (SparseRequest(self._calls, label), time.monotonic())
                if self._watchdog is None:  # (also once the engine is closed: see _watch)
                    self._start_watchdog()
            yield
        finally:
            with self._cond:
                entry = self._blocking.pop(me, None)
                if entry is not None:
                    self._ended_call(entry[0])
                self._cond.notify_all()  # (stop() may wait for it)

    def watches_this_thread(self) -> bool:
        """Whether the calling thread is in a watched blocking call (:meth:`watching`)."""
        return threading.get_ident() in self._blocking

    def _ended_call(self, req: SparseRequest) -> None:
        # (under self._cond)
        self._done += 1
        if req.call > self._last_call:
            self._last, self._last_call = req.label, req.call

    def _running(self) -> list[tuple[SparseRequest, float]]:
        """The calls in progress (queued and blocking) with their start times, oldest first."""
        with self._cond:
            running = list(self._blocking.values())
            if self._current is not None:
                running.append((self._current, self._started))
        return sorted(running, key=lambda r: r[0].call)

    def drain(self) -> None:
        """Wait until every call submitted so far has completed.

        Raises:
            RuntimeError: called on the progress thread with calls pending (its own call
                among them): only this thread completes them.
        """
        self._check_process()
        if self._completed == self._submitted and self._up:
            return
        if self.is_worker_thread():
            raise RuntimeError(
                f"drain() on the progress thread with {self.pending()} call(s) pending "
                f"(its own among them): only this thread completes them; it would wait "
                f"for ever"
            )
        with self._cond:
            target = self._submitted
            while self._completed < target or not self._up:
                self._cond.wait()

    def _check_process(self) -> None:
        """Refuse to be used in a child made by fork(): its queue would never run and its
        MPI state is not the child's."""
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"process {os.getpid()} was forked from the one that started this "
                f"communicator's progress thread ({self._pid}): MPI and the thread do not "
                f"carry over to a child; communicate from the parent"
            )

    def route(self, comm: Any) -> Any:
        """The Communicator that ``comm``'s calls should use from the calling thread."""
        if threading.get_ident() == self._thread.ident:
            return self._comm
        self.drain()
        return comm

    def is_worker_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def pending(self) -> int:
        """How many submitted calls have not completed (the engine's start counts as one)."""
        return self._submitted - self._completed + (not self._up)

    def cpu_time(self) -> float:
        """CPU seconds the progress thread has used so far (Linux, macOS)."""
        ident = self._thread.ident
        if ident is None or not self._thread.is_alive():
            return 0.0
        return time.clock_gettime(time.pthread_getcpuclockid(ident))

    def close(self, wait: bool = True, free: bool = False) -> None:
        """Accept no more calls; the thread ends after the queued ones (joined if ``wait``).

        ``free``: the thread then frees the engine's two duplicate communicators (when the
        user's communicator is freed: each engine holds two MPI context ids, of which MPI has
        only a few thousand)."""
        with self._cond:
            self._closed = True
            self._free = self._free or free
            self._cond.notify_all()
        if wait and not self.is_worker_thread():
            self._thread.join()

    def _settle(self) -> None:
        """Wait (see :func:`stop`) until the watched blocking calls that other threads have
        in flight now have ended, or the watchdog is off, then let the watchdog end."""
        me = threading.get_ident()
        with self._cond:
            inflight = {r.call for t, (r, _) in self._blocking.items() if t != me}
            while inflight and self._watchdog is not None and limit(self.timeout):
                self._cond.wait(WATCH_PERIOD)  # (get_timeout() may change meanwhile)
                inflight &= {r.call for r, _ in self._blocking.values()}
            self._stopped = True

    # -- the progress thread ----------------------------------------------------------------
    def _begin(self) -> None:
        """Run the start; on failure close the engine (its calls get the start's error)."""
        start, self._start = self._start, None
        try:
            self._comm, self._alarm = start()
        except BaseException as exc:
            self.failed = exc  # (set before any request completes: see _attached_engine)
        with self._cond:
            if self.failed is not None:
                self._closed = True
            self._up = True
            self._ready.set()
            self._cond.notify_all()

    def _loop(self) -> None:
        self._begin()
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    self._ended = True
                    free, watchdog = self._free, self._watchdog
                    break
                req, fn, owner, scopes = self._queue.popleft()
                self._current, self._started = req, time.monotonic()
            if self.failed is not None:
                value, error = None, self.failed
            else:
                before = self._comm.stats.copy()
                try:
                    value, error = fn(), None
                except BaseException as exc:  # the error belongs to the request
                    value, error = None, exc
                if owner is not None and owner is not self._comm:
                    owner._add_stats(self._comm.stats - before, scopes)
            with self._cond:
                self._current = None
                self._ended_call(req)
                self._completed += 1
                # after the count: whoever sees the request done sees it no longer pending
                # (the exit handler aborts the job when calls are pending)
                req._finish(value, error)
                self._cond.notify_all()
            # the thread waits for the next call with nothing of this one: its result (a
            # dense update) and its arguments (a gradient) are the caller's alone
            del req, fn, owner, scopes, value, error
        if free and self._comm is not None:  # every rank frees the user's communicator
            if watchdog is not None:
                watchdog.join()  # it stops once _ended is set
            self._comm.mpi_comm.Free()
            self._alarm.mpi_comm.Free()

    # -- watchdog ---------------------------------------------------------------------------
    def _start_watchdog(self) -> None:
        with self._cond:
            # (after the thread ended: only for blocking calls, while the duplicates live;
            # none once stop() ran: at exit, at MPI_Finalize)
            if self._watchdog is not None or (self._ended and (self._free or self._stopped)):
                return
            self._watchdog = threading.Thread(
                target=self._watch, name=f"sparsecoll-watchdog-{self.rank}", daemon=True
            )
            self._watchdog.start()  # under the lock: the thread's end may join it

    def _watch(self) -> None:
        # The timeout holds for the communicator's whole life: after the progress thread
        # ended (close(), stop()), a blocking call still runs the watchdog (or starts it
        # again). It ends with the engine's duplicates (the user's communicator was freed),
        # and once stop() has seen the blocking calls in flight end (at exit).
        while True:
            with self._cond:
                if self._ended and (self._free or self._stopped or not self._blocking):
                    self._watchdog = None  # (under the lock: watching() starts another)
                    return
            time.sleep(WATCH_PERIOD)
            watch = limit(self.timeout)
            late = (
                [r for r, t in self._running() if time.monotonic() - t > watch[0]] if watch else []
            )
            if late:
                self._fire(watch, late[0].call)
            alarm = None if self._alarm is None else self._alarm.try_recv_ints(ALARM_TAG)
            if alarm is not None:
                self._report(f"rank {alarm[0]} timed out in its call #{alarm[1][0]}")
                self._answer(alarm[0])

    def _answer(self, rank: int) -> None:
        """Send this rank's state to ``rank``, whose watchdog fired (it prints who is where)."""
        msg = np.frombuffer(_pad(f"{self._now()}\n{self.state()}".encode()), np.int64)
        self._answers.append((self._alarm.isend(msg, rank, ANSWER_TAG), msg))

    def _now(self) -> str:
        """The call this rank is in ("#3 allreduce(...)"), or "" when idle."""
        running = self._running()
        return f"#{running[0][0].call} {running[0][0].label}" if running else ""

    def state(self) -> str:
        """This rank's progress: which call it has reached, with which algorithm."""
        running = self._running()
        with self._cond:
            calls, done, last, last_call = self._calls, self._done, self._last, self._last_call
        if running:
            req, started = running[0]
            now = f"in call #{req.call} {req.label} for {time.monotonic() - started:.1f} s"
        elif last_call:
            now = f"idle after call #{last_call} {last}"
        else:
            now = "idle, no call yet"
        return f"{now} ({calls} started, {done} completed)"

    def _report(self, why: str) -> None:
        if self._reported:
            return
        self._reported = True
        _stderr(f"sparsecoll watchdog: rank {self.rank} of {self.size}: {self.state()}; {why}")

    def abort(self, code: int) -> None:
        """MPI_Abort: end every process of the job."""
        (self._alarm.abort if self._alarm is not None else self._abort_job)(code)

    def _fire(self, watch: tuple[float, str], call: int) -> None:
        c = self._alarm
        self._report(f"timeout {watch[0]:g} s expired ({watch[1]}); aborting the job")
        if c is None:  # (no call runs before the start has made it: not expected)
            self.abort(1)
            return
        msg = np.array([call], dtype=np.int64)
        sends = [c.isend(msg, r, ALARM_TAG) for r in range(c.size) if r != c.rank]
        # the other ranks print their state meanwhile, and answer with it
        _stderr(f"sparsecoll watchdog: rank {c.rank} of {c.size}: {self._others(GRACE)}")
        del sends
        c.abort(1)

    def _others(self, grace: float) -> str:
        """Where the other ranks are, from their answers within ``grace`` seconds: in this
        rank's call, in another (or idle), or silent. A rank whose own watchdog fired too
        answers here (it waits for answers as this one does)."""
        c, mine = self._alarm, self._now()
        where: dict[int, str] = {}
        end = time.monotonic() + grace
        while len(where) < c.size - 1 and time.monotonic() < end:
            alarm = c.try_recv_ints(ALARM_TAG)
            if alarm is not None:
                self._answer(alarm[0])
            got = c.try_recv_ints(ANSWER_TAG)
            if got is None:
                time.sleep(WATCH_PERIOD / 5)
                continue
            text = np.array(got[1], np.int64).tobytes().rstrip(b"\0").decode()
            now, state = text.split("\n", 1)
            where[got[0]] = "in it" if now == mine else state
        silent = f"did not answer within {grace:g} s (exited, in MPI_Finalize, or no watchdog)"
        by: dict[str, list[int]] = {"in it": [c.rank]}
        for r in range(c.size):
            if r != c.rank:
                by.setdefault(where.get(r, silent), []).append(r)
        return f"call {mine}: " + "; ".join(
            f"{ranks_text(sorted(rs))} {what}" for what, rs in by.items()
        )


def ranks_text(ranks: list[int]) -> str:
    """'rank 1' or 'ranks 0, 2'."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _pad(data: bytes) -> bytes:
    """``data`` padded with NULs to a whole number of int64s (how the answers travel)."""
    return data + b"\0" * (-len(data) % 8)


def _stderr(line: str) -> None:
    try:
        os.write(2, (line + "\n").encode())
    except OSError:  # pragma: no cover - stderr closed
        print(line, file=sys.stderr, flush=True)


def shutdown() -> None:
    """At interpreter exit: let every engine finish its queued calls, then stop its thread.

    Pending requests are completed (every rank submitted them, so their collectives
    match); a call that cannot complete hangs here unless the watchdog is on. After an
    uncaught exception, or when this wait is interrupted (KeyboardInterrupt), with calls
    still in progress, the job is aborted (MPI_Abort): the other ranks may never reach
    them, and this rank's MPI_Finalize would wait for theirs.
    """
    engines = _own_engines()
    for engine in engines:
        engine.close(wait=False)
    if getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None:
        pending = sum(e.pending() for e in engines)
        _abort(engines, pending, f"uncaught exception with {pending} nonblocking call(s) pending")
        return
    try:
        stop(engines)
    except KeyboardInterrupt:
        busy = sum(e.pending() + len(e._blocking) for e in engines)
        _abort(engines, busy, f"interrupted at exit with {busy} call(s) in progress")
        raise


def _own_engines() -> list[Engine]:
    """This process's engines (in a forked child: none, whose calls are the parent's)."""
    with _registry_lock:
        return [e for e in _engines if e._pid == os.getpid()]


def _abort(engines: list[Engine], calls: int, why: str) -> None:
    """At exit, with ``calls`` calls in progress (none: nothing happens): MPI_Abort, after a
    line on stderr with ``why`` and the state of the first engine that has calls."""
    if calls:
        e = next((x for x in engines if x.pending() or x._blocking), engines[0])
        _stderr(f"sparsecoll: rank {e.rank} of {e.size}: {why} ({e.state()}); aborting the job")
        e.abort(1)


def stop(engines: list[Engine] | None = None) -> None:
    """Complete the calls queued to ``engines`` (default: every engine of this process),
    then end their threads. Also run when MPI_Finalize starts (see Communicator.engine).

    The watched blocking calls that other threads (daemon threads, at exit) have in flight
    now are waited for, as long as the watchdog watches them (it aborts the job past the
    timeout); the watchdog then ends. Blocking calls these threads start later are neither
    waited for nor watched: a thread that goes on calling would hold the exit for ever.
    """
    if engines is None:
        engines = _own_engines()
    for engine in engines:
        engine.close(wait=True)
        engine._settle()
        watchdog = engine._watchdog  # (it sets None as it ends)
        if watchdog is not None:
            watchdog.join()
