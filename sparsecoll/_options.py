"""Checks of constructor options: a wrong type raises TypeError, a wrong value ValueError, each
naming the option and what it takes (float() and bool() took strings, None and True)."""

from __future__ import annotations

import numbers
import os
from typing import Any

import numpy as np

__all__ = [
    "check_density",
    "choice",
    "count_band",
    "env_flag",
    "env_integer",
    "flag",
    "integer",
    "real",
]


def real(name: str, value: Any) -> float:
    """``value`` (a Python or numpy real number, not a bool) as a float."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def check_density(value: Any) -> float:
    """``value`` (a real number in (0, 1]: a fraction of entries to keep) as a float."""
    value = real("density", value)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {value!r}")
    return value


def integer(name: str, value: Any, low: int) -> int:
    """``value`` (a Python or numpy integer, not a bool, at least ``low``) as an int: a
    TypeError for another type (a float, even 3.0, as numpy's ``np.zeros(3.0)``), a
    ValueError for an integer below ``low``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be an integer >= {low}, got {value!r} ({type(value).__name__})"
        )
    if value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def flag(name: str, value: Any) -> bool:
    """``value`` (True or False, a numpy bool too) as a bool: bool() took any object ("no")."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__}")
    return bool(value)


def choice(name: str, value: Any, choices: Any) -> str:
    """``value`` (a str among ``choices``): a TypeError for another type, a ValueError for
    another name."""
    what = f"{name} must be one of {', '.join(choices)}, got {value!r}"
    if not isinstance(value, str):
        raise TypeError(f"{what} ({type(value).__name__})")
    if value not in choices:
        raise ValueError(what)
    return value


def count_band(name: str, value: Any) -> tuple[float, float]:
    """``value`` (a pair of real numbers ``(low, high)`` with ``0 <= low <= 1 <= high``: a
    band of counts as multiples of k) as a tuple of floats."""
    what = f"{name} must be a pair (low, high) of real numbers with 0 <= low <= 1 <= high"
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
        raise TypeError(f"{what}, got {value!r}")
    lo, hi = (real(f"{name}[{i}]", v) for i, v in enumerate(value))
    if not 0.0 <= lo <= 1.0 <= hi:
        raise ValueError(f"{what}, got {value!r}")
    return lo, hi


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_flag(name: str, default: bool | None) -> bool | None:
    """The environment variable ``name`` as a bool (1/true/yes/on, 0/false/no/off, any
    case); ``default`` when unset or empty; a ValueError naming it for another value (it was
    read as false, silently)."""
    raw = os.environ.get(name, "")
    text = raw.strip().lower()
    if not text:
        return default
    if text not in _TRUE + _FALSE:
        raise ValueError(
            f"{name} must be one of {', '.join(_TRUE)} (on) or {', '.join(_FALSE)} (off), "
            f"got {raw!r}"
        )
    return text in _TRUE


def env_integer(name: str, low: int) -> int | None:
    """The environment variable ``name`` as an integer >= ``low``; None when unset or empty;
    a ValueError naming it for another value (it was dropped, silently)."""
    raw = os.environ.get(name, "")
    try:
        value = int(raw.strip()) if raw.strip() else None
    except ValueError:
        value = low - 1
    if value is not None and value < low:
        raise ValueError(f"{name} must be an integer >= {low} (unset: the default), got {raw!r}")
    return value
