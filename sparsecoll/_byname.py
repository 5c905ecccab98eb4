"""Warn when a stateful selecting algorithm is called by name again with the same options.

``allreduce(..., algorithm="oktopk", k=K)`` builds a new instance for every call, so a call
by name depends on its arguments alone: the same input gives the same result whatever ran
before. The state that makes oktopk and exdyna fast over a stream of calls (a reused
threshold, oktopk's regions) then starts anew every call. The first repeat of one
(algorithm, options, n) in a process warns once per algorithm, with the fix: build one
instance and pass it to every call of the stream. Selecting algorithms that declare no state
(``state_kinds = {}``, gtopk) and exact ones never warn. Every rank makes the same calls, so
every rank warns at the same call; nothing here communicates.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

from ._options import canonical

__all__ = ["forget", "note_named_call"]

REMEMBERED = 256  # the most recent (algorithm, options, n) keys a repeat is looked for in

_lock = threading.Lock()
_seen: dict[tuple[str, str, str], None] = {}  # (insertion order: the oldest first)
_warned: set[str] = set()


def note_named_call(algo: Any, options: dict[str, Any], n: Any, stacklevel: int = 4) -> None:
    """Note a call by name that built ``algo`` from ``options`` for length ``n``; warn
    (UserWarning, once per algorithm) when it repeats an earlier such call and the algorithm
    keeps state between calls. ``stacklevel``: the user's frame, seen from here."""
    cls = type(algo)
    if cls.exact or cls.state_kinds == {}:
        return
    name = cls.name or cls.__qualname__
    given = repr(sorted(canonical(options).items()))
    key = (f"{cls.__module__}.{cls.__qualname__}", given, repr(n))
    with _lock:
        repeat = key in _seen
        _seen.pop(key, None)
        _seen[key] = None
        if len(_seen) > REMEMBERED:
            del _seen[next(iter(_seen))]
        if not repeat or name in _warned:
            return
        _warned.add(name)
    given = ", ".join(f"{k}={v!r}" for k, v in sorted(options.items()))
    warnings.warn(  # (outside the lock: a filter turning it into an error raises here)
        f"sparsecoll.allreduce(algorithm={name!r}) by name builds a new instance every call: "
        f"the state {name} keeps between calls (its reused threshold) starts anew each time, "
        f"which costs more time and messages per call. For a stream of calls, build one "
        f"instance on every rank and pass it to every call: "
        f"algo = sparsecoll.get_algorithm({name!r}{', ' if given else ''}{given}); "
        f"sparsecoll.allreduce(..., algorithm=algo) (one instance per stream, e.g. per layer)",
        UserWarning,
        stacklevel=stacklevel,
    )


def forget() -> None:
    """Forget the calls noted and the warnings given (tests)."""
    with _lock:
        _seen.clear()
        _warned.clear()
