"""How a Communicator's methods run: on which communicator, under which lock, watched or not.

:func:`routed` wraps each communication method. Called from the progress engine's thread,
the call runs on the engine's duplicate; from any other thread, it first waits until every
request submitted to the engine has completed, so that a blocking call is ordered after the
nonblocking ones issued before it. Either way it holds the lock that runs this rank's calls
on the MPI communicator one at a time (``Communicator.serial``), on the GPU of its first
device array. With the watchdog on, a public method called directly is watched as a
blocking call (:func:`_watch_direct`). A thread's first take of that lock, off the progress
thread, runs :data:`before_calls` first (:func:`first_take`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any

from ._agree import watch
from ._buffers import buffers_device
from ._timeout import get_timeout

__all__ = ["Apart", "before_calls", "first_take", "routed", "thread_state"]


class Apart(threading.local):
    """A Communicator's per-thread message communicator (None: the user's; see apart())."""

    comm: Any = None  # (a class default: a thread that never set one reads it at no cost)


thread_state = threading.local()  # .starting: this thread is starting an engine

# called with the Communicator before a call on it (see first_take): the JAX integration's
# wait for the jitted programs dispatched before, whose calls come first on every rank
before_calls: list[Callable[[Any], None]] = []

# Communicator methods that talk to one rank, not to all: they cannot start a progress
# engine (a collective start) to be watched, only be watched by one already running
_POINT_TO_POINT = frozenset({"send", "recv", "sendrecv", "recv_bytes", "sendrecv_ints"})
_NOT_BLOCKING = frozenset({"isend", "irecv", "iallreduce_ints"})  # nothing to watch


def routed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a communication method on the progress engine's duplicate when called from the
    engine's thread; from any other thread, wait for the engine's pending work first.

    With the watchdog on, a public method called directly (not inside a watched call) is
    watched as a blocking call, labelled ``Communicator.<name>()`` (:func:`_watch_direct`).
    """
    name = fn.__name__
    label = f"Communicator.{name}()"
    watched = not name.startswith("_") and name not in _NOT_BLOCKING
    collective = name not in _POINT_TO_POINT

    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        engine = self._attached_engine()
        user = self
        if engine is not None:
            self = engine.route(self)
        # (what serial() takes: routed, the call runs on the Communicator it locks)
        lock = self._own_lock()
        if self is user:  # (not on the progress thread, which runs the engine's duplicate)
            first_take(user, lock)
        with lock, buffers_device(args):
            if not watched or not get_timeout():
                return fn(self, *args, **kwargs)
            with _watch_direct(user, engine, label, collective):
                return fn(self, *args, **kwargs)

    return call


def first_take(comm: Any, lock: Any) -> Any:
    """Return ``comm``'s ``lock``, after running :data:`before_calls` when this thread does
    not hold it yet (the first take of a call)."""
    if before_calls and not lock._is_owned():
        for hook in before_calls:
            hook(comm)
    return lock


def _watch_direct(
    comm: Any, engine: Any, label: str, collective: bool
) -> contextlib.AbstractContextManager[None]:
    """Watch a Communicator method that the user calls directly (the watchdog is on) as a
    blocking call. Not watched again: a call inside a watched one, on the progress thread,
    on the engine's own duplicates, while an engine starts, and a point-to-point call on a
    communicator with no engine yet (starting one is collective: the ranks not in the
    exchange would never join it)."""
    if comm._internal or getattr(thread_state, "starting", False):
        return contextlib.nullcontext()
    if engine is None:
        if not collective:
            return contextlib.nullcontext()
    elif engine.is_worker_thread() or engine.watches_this_thread():
        return contextlib.nullcontext()
    return watch(comm, label)
