"""Waiting without spinning a core: :func:`poll`, and :class:`Request` (a pending MPI
operation with its copy-back).

A polling wait tests the operation in a short spin that yields the core, then sleeps of an
eighth of the time waited so far, at most 1 ms: the latency it adds is at most about 1/8
of the wait, and a long wait tests about once a millisecond. MPI advances a nonblocking
collective's rounds only inside Test calls, so a wait's sleeps stay proportional to it
rather than capped at a fixed back-off.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import _mpilib

__all__ = ["POLL_FRACTION", "POLL_MAX", "POLL_MIN", "POLL_SPIN", "Request", "poll"]

POLL_SPIN = 50e-6  # seconds of Test calls (with sched_yield) before the first sleep
POLL_FRACTION = 1 / 8  # each sleep: this fraction of the time waited so far...
POLL_MIN = 20e-6  # ...but at least this (seconds)
POLL_MAX = 1e-3  # ...and at most this: a long wait tests about once a millisecond
PR_SET_TIMERSLACK = 29

_yield = getattr(os, "sched_yield", lambda: time.sleep(0))
_thread_state = threading.local()


def poll(test: Callable[[], Any]) -> Any:
    """Call ``test`` until it returns something true (returned), without spinning a core."""
    if flag := test():
        return flag
    _fine_timer_slack()
    start = time.perf_counter()
    while time.perf_counter() - start < POLL_SPIN:
        _yield()
        if flag := test():
            return flag
    while not (flag := test()):
        waited = time.perf_counter() - start
        time.sleep(min(max(waited * POLL_FRACTION, POLL_MIN), POLL_MAX))
    return flag


def _fine_timer_slack() -> None:
    """Let this thread's short sleeps be short (Linux, once per thread): a sleep may
    overrun by the thread's timer slack, 50 µs by default, more than the shortest sleeps
    asked for; a slack of 1 ns leaves the timer's own overhead."""
    if getattr(_thread_state, "slack", False):
        return
    _thread_state.slack = True
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)


class Request:
    """A pending nonblocking operation; ``wait()`` completes it (and any device copy-back).

    ``poll``: complete it by Test calls with sleeps (:func:`poll`), not Wait.
    """

    __slots__ = ("_done", "_finish", "_keep", "_poll", "_req")

    def __init__(
        self,
        req: Any,
        finish: Callable[[], None] | None = None,
        keep: Any = None,
        poll: bool = False,
    ) -> None:
        self._req = req
        self._finish = finish
        self._keep = keep  # a staged send buffer must outlive the request
        self._done = False
        self._poll = poll

    def wait(self) -> None:
        if not self._done:
            if self._poll:
                poll(self._req.Test)
            else:
                self._req.Wait()
            self._complete()

    def _complete(self) -> None:
        self._done = True
        if self._finish is not None:
            self._finish()
            self._finish = None
        self._keep = None

    @staticmethod
    def waitall(requests: Sequence[Request]) -> None:
        pending = [r for r in requests if not r._done]
        if any(type(r) is not Request for r in pending):  # another transport's: one by one
            for r in pending:
                r.wait()
        elif pending:
            reqs = [r._req for r in pending]
            if any(r._poll for r in pending):
                poll(lambda: _mpilib.mpi().Request.Testall(reqs))
            else:
                _mpilib.mpi().Request.Waitall(reqs)
            for r in pending:
                r._complete()
