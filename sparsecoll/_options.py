"""Checks of constructor options: a wrong type raises TypeError, a wrong value ValueError, each
naming the option and what it takes (float() and bool() took strings, None and True)."""

from __future__ import annotations

import functools
import inspect
import numbers
import operator
import os
from typing import Any

import numpy as np

__all__ = [
    "canonical",
    "check_density",
    "choice",
    "count_band",
    "effective_options",
    "env_flag",
    "env_integer",
    "flag",
    "integer",
    "read_only",
    "real",
]


def real(name: str, value: Any) -> float:
    """``value`` (a Python or numpy real number, not a bool) as a float; -0.0 as 0.0 (one
    value: the ranks agree on options by their reprs, where -0.0 and 0.0 differed)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value) + 0.0


def read_only(attr: str, name: str, doc: str | None = None) -> property:
    """A property reading ``attr`` (a dotted path, as :func:`operator.attrgetter` takes)
    whose setter raises the owner's ``_refuse(name, value)``: an option fixed at
    construction, whose AttributeError says why and what to do instead."""
    return property(
        operator.attrgetter(attr), lambda self, value: self._refuse(name, value), doc=doc
    )


def check_density(value: Any) -> float:
    """``value`` (a real number in (0, 1]: a fraction of entries to keep) as a float."""
    value = real("density", value)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {value!r}")
    return value


def integer(name: str, value: Any, low: int, *, int64: bool = False) -> int:
    """``value`` (a Python or numpy integer, not a bool, at least ``low``) as an int: a
    TypeError for another type (a float, even 3.0, as numpy's ``np.zeros(3.0)``), a
    ValueError for an integer below ``low``, or with ``int64`` (a value the ranks agree on
    as an int64) at or above 2**63."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be an integer >= {low}, got {value!r} ({type(value).__name__})"
        )
    if value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if int64 and value >= 2**63:
        raise ValueError(f"{name} must be below 2**63, got {value!r}")
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


def canonical(value: Any) -> Any:
    """``value`` as plain Python values that compare and print alike on every rank: numbers
    as int or float (a numpy scalar as the Python one, -0.0 as 0.0), containers and numpy
    arrays item by item (as tuples), and any other object as its type's name alone (its
    repr may hold an address; what it does is not compared)."""
    if value is None or isinstance(value, (str, bool, np.bool_)):
        return value if not isinstance(value, np.bool_) else bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value) + 0.0  # (-0.0 as 0.0)
    if isinstance(value, (list, tuple)):
        return tuple(canonical(v) for v in value)
    # (an array option, band=np.array(...), by its values: by its type alone, ranks given
    # other values agreed)
    if isinstance(value, np.ndarray):
        return canonical(value.tolist())
    if isinstance(value, dict):
        return {str(k): canonical(v) for k, v in value.items()}
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def effective_options(
    cls: Any, given: dict[str, Any], leave_out: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The options ``cls`` (an algorithm or a selection estimator; None: no options) is built
    with, by name: its constructor's defaults, then ``given``; without those in
    ``leave_out``. (Without a signature that inspect can read: ``given`` alone.)"""
    if cls is None:
        return {}
    options = dict(_defaults(cls))
    options.update(given)
    # (a list and a tuple of the same values, e.g. band=, are the same option)
    return {
        name: tuple(value) if isinstance(value, list) else value
        for name, value in sorted(options.items())
        if name not in leave_out
    }


@functools.cache
def _defaults(cls: Any) -> tuple[tuple[str, Any], ...]:
    """The constructor defaults of ``cls`` (read once: allreduce reads them at every call)."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple((p.name, p.default) for p in params if p.default is not inspect.Parameter.empty)
