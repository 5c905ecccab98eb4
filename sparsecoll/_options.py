"""Checks of constructor options: a wrong type raises TypeError, a wrong value ValueError, each
naming the option and what it takes (stricter than float() and bool(), which take strings)."""

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
    """Return ``value`` (a real number, not a bool) as a float, -0.0 as 0.0: ranks compare reprs."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value) + 0.0


def read_only(attr: str, name: str, doc: str | None = None) -> property:
    """Return a property reading ``attr`` (dotted) whose setter raises the owner's ``_refuse``."""
    return property(
        operator.attrgetter(attr), lambda self, value: self._refuse(name, value), doc=doc
    )


def check_density(value: Any) -> float:
    """Return ``value`` (a real number in (0, 1]: a fraction of entries to keep) as a float."""
    value = real("density", value)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {value!r}")
    return value


def integer(name: str, value: Any, low: int, *, int64: bool = False) -> int:
    """Return ``value`` (an integer >= ``low``, not a bool; with ``int64`` below 2**63) as an int.

    A float, even 3.0, is a TypeError (as in ``np.zeros(3.0)``); out of range, a ValueError.
    """
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
    """Return ``value`` (True or False, a numpy bool too) as a bool; other objects are refused."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__}")
    return bool(value)


def choice(name: str, value: Any, choices: Any) -> str:
    """Return ``value``, a str among ``choices`` (TypeError for another type, else ValueError)."""
    what = f"{name} must be one of {', '.join(choices)}, got {value!r}"
    if not isinstance(value, str):
        raise TypeError(f"{what} ({type(value).__name__})")
    if value not in choices:
        raise ValueError(what)
    return value


def count_band(name: str, value: Any) -> tuple[float, float]:
    """Return ``value``, reals ``(low, high)`` with ``0 <= low <= 1 <= high``, as two floats."""
    what = f"{name} must be a pair (low, high) of real numbers with 0 <= low <= 1 <= high"
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
        raise TypeError(f"{what}, got {value!r}")
    lo, hi = (real(f"{name}[{i}]", v) for i, v in enumerate(value))
    if not 0.0 <= lo <= 1.0 <= hi:
        raise ValueError(f"{what}, got {value!r}")
    return lo, hi


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_flag(name: str, default: bool | None) -> bool | None:
    """Return the environment variable ``name`` as a bool (1/true/yes/on, 0/false/no/off).

    ``default`` when unset or empty; another value is a ValueError naming it.
    """
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
    """Return the environment variable ``name`` as an integer >= ``low`` (None: unset or empty)."""
    raw = os.environ.get(name, "")
    try:
        value = int(raw.strip()) if raw.strip() else None
    except ValueError:
        value = low - 1
    if value is not None and value < low:
        raise ValueError(f"{name} must be an integer >= {low} (unset: the default), got {raw!r}")
    return value


def canonical(value: Any) -> Any:
    """Return ``value`` as plain Python values that compare and print alike on every rank.

    Numbers as int or float (-0.0 as 0.0), containers and arrays as tuples, any other object as
    its type's name (its repr may hold an address).
    """
    if value is None or isinstance(value, (str, bool, np.bool_)):
        return value if not isinstance(value, np.bool_) else bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value) + 0.0  # -0.0 as 0.0
    if isinstance(value, (list, tuple)):
        return tuple(canonical(v) for v in value)
    # an array option (band=np.array(...)) is compared by its values, not by its type
    if isinstance(value, np.ndarray):
        return canonical(value.tolist())
    if isinstance(value, dict):
        return {str(k): canonical(v) for k, v in value.items()}
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def effective_options(
    cls: Any, given: dict[str, Any], leave_out: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Return the options ``cls`` is built with: its defaults updated by ``given``.

    Names in ``leave_out`` are left out; ``cls`` None has no options.
    """
    if cls is None:
        return {}
    options = dict(_defaults(cls))
    options.update(given)
    # a list and a tuple of the same values (band=) are the same option
    return {
        name: tuple(value) if isinstance(value, list) else value
        for name, value in sorted(options.items())
        if name not in leave_out
    }


@functools.cache
def _defaults(cls: Any) -> tuple[tuple[str, Any], ...]:
    """Return the constructor defaults of ``cls`` (cached: allreduce reads them every call)."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple((p.name, p.default) for p in params if p.default is not inspect.Parameter.empty)
