"""The watchdog's timeout: the process-wide one (:func:`set_timeout`,
``SPARSECOLL_TIMEOUT``), and a communicator's own (:func:`limit`: the smaller of the two
holds). This module imports no other of sparsecoll's."""

from __future__ import annotations

import math
import numbers
import os
import threading
from typing import Any

import numpy as np

__all__ = ["get_timeout", "limit", "set_timeout"]

_timeout: float | None = None
_timeout_read = False


def _seconds(name: str, value: Any) -> float | None:
    """``value`` (None, or a Python or numpy real number of seconds, not a bool) as a float;
    past ``threading.TIMEOUT_MAX`` (infinity too) as None: no limit (waits and timers
    raise OverflowError there). A TypeError for another type (a str, a bool), a ValueError
    for NaN."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a number of seconds or None, got {value!r} ({type(value).__name__})"
        )
    seconds = float(value)
    if math.isnan(seconds):
        raise ValueError(f"{name} must be a number of seconds or None, got {seconds!r}")
    return None if seconds > threading.TIMEOUT_MAX else seconds


def set_timeout(seconds: float | None) -> None:
    """Turn the watchdog on (a timeout in seconds) or off (None, 0 or infinity), on this rank.

    Set the same value on every rank (``SPARSECOLL_TIMEOUT`` in the job's environment
    does). With a timeout, blocking :func:`sparsecoll.allreduce` calls (and
    ``GradientReducer.step``) are watched too: they still run in the calling thread (their
    input agreement on the user's communicator, the algorithm's messages on the duplicate
    that blocking calls share, not the progress engine's), and the engine's watchdog times
    them.

    Raises:
        TypeError: ``seconds`` is not None or a real number (a str, a bool).
        ValueError: ``seconds`` is negative or NaN.
    """
    global _timeout, _timeout_read
    value = _seconds("timeout", seconds)
    if value is not None and not value >= 0:
        raise ValueError(f"timeout must be >= 0 seconds or None, got {value!r}")
    _timeout = value or None
    _timeout_read = True


def get_timeout() -> float | None:
    """The watchdog's timeout in seconds (None: off); ``SPARSECOLL_TIMEOUT`` is read once."""
    global _timeout_read
    if not _timeout_read:
        env = os.environ.get("SPARSECOLL_TIMEOUT", "").strip()
        try:
            set_timeout(float(env) if env else None)
        except ValueError:
            raise ValueError(
                f"SPARSECOLL_TIMEOUT must be a number of seconds >= 0 (0 or empty: off), "
                f"got {env!r}"
            ) from None
        _timeout_read = True
    return _timeout


def limit(own: tuple[float, str] | None = None) -> tuple[float, str] | None:
    """The watchdog's limit on a communicator whose own timeout is ``own`` (seconds, and
    what sets it, for the diagnostic): the smaller of it and :func:`get_timeout`, with
    what sets that one; None: no limit."""
    seconds = get_timeout()
    if own is not None and own[0] and (seconds is None or own[0] <= seconds):
        return own
    return None if seconds is None else (seconds, "SPARSECOLL_TIMEOUT")
