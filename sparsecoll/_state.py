"""Checking a saved state before it is restored: a stateful algorithm's (a GradientReducer
checkpoint's ``algorithm_state``: the instance's attributes) and a selection estimator's
(its ``selection_state``: the estimator's slots), alike.

An algorithm (an estimator) lists what its calls change in ``state_kinds``: each
attribute's kind, a function ``(value, n, size) -> value`` that returns what to restore
(the value itself, or for an array a native int64 host copy) or raises TypeError (wrong
type) or ValueError. Its other attributes are the constructor's: a saved state must hold
the same values (loading would otherwise run the saved options under this instance's
name), and they are not written over. Values are restored as saved, not converted: a
threshold saved as a numpy float32 keeps its arithmetic (a Python float would round the
next steps differently).
"""

from __future__ import annotations

import copy
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np

from ._array import as_array, to_host

__all__ = [
    "Kind",
    "boolean",
    "check_saved",
    "check_values",
    "count",
    "length",
    "number",
    "optional",
    "positive",
    "problem",
    "ranks",
    "signed",
    "splits",
    "within",
]

Kind = Callable[[Any, int, int], Any]


def _integral(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def signed(value: Any, n: int, size: int) -> Any:
    """An integer (Python or numpy, not a bool)."""
    if not _integral(value):
        raise TypeError(f"must be an integer, got {type(value).__name__}")
    return value


def count(value: Any, n: int, size: int) -> Any:
    """An integer >= 0."""
    if signed(value, n, size) < 0:
        raise ValueError(f"must be an integer >= 0, got {value!r}")
    return value


def number(value: Any, n: int, size: int) -> Any:
    """A real number (Python or numpy, not a bool; NaN and infinities too: a threshold may
    be either after a call on such data)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"must be a real number, got {type(value).__name__}")
    return value


def positive(value: Any, n: int, size: int) -> Any:
    """A real number > 0 (a threshold; infinity too: the one an exact step keeps at k = 0)."""
    if not number(value, n, size) > 0:  # (NaN too)
        raise ValueError(f"must be a number > 0, got {value!r}")
    return value


def within(low: float, high: float) -> Kind:
    """A real number in [low, high] (NaN is not)."""

    def check(value: Any, n: int, size: int) -> Any:
        if not low <= number(value, n, size) <= high:
            raise ValueError(f"must be a number in [{low}, {high}], got {value!r}")
        return value

    return check


def boolean(value: Any, n: int, size: int) -> Any:
    """True or False (a numpy bool too)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"must be True or False, got {type(value).__name__}")
    return value


def optional(kind: Kind) -> Kind:
    """None, or a value of ``kind``."""

    def check(value: Any, n: int, size: int) -> Any:
        return None if value is None else kind(value, n, size)

    return check


def length(value: Any, n: int, size: int) -> Any:
    """None (not set up yet) or the problem's length n."""
    if value is not None and signed(value, n, size) != n:
        raise ValueError(f"is for n={value}, this reducer has n={n}")
    return value


def ranks(value: Any, n: int, size: int) -> Any:
    """None (not set up yet) or the number of ranks."""
    if value is not None and signed(value, n, size) != size:
        raise ValueError(f"is for {value} ranks, this communicator has {size}")
    return value


def problem(value: Any, n: int, size: int) -> Any:
    """None (not set up yet) or the pair ``(n, size)``."""
    if value is None:
        return None
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"must be None or a pair (n, ranks), got {value!r}")
    length(value[0], n, size)
    ranks(value[1], n, size)
    return tuple(value)


def splits(value: Any, n: int, size: int) -> Any:
    """None, or ``size + 1`` ascending integers from 0 (region or partition bounds): a new
    native int64 array on the host, whatever array (or list) was saved (read-only, strided,
    of another byte order, on a GPU)."""
    if value is None:
        return None
    try:
        arr, _ = as_array(value, "bounds")
        arr = np.array(to_host(arr), copy=True)
    except TypeError as exc:
        kind = type(value).__name__
        raise TypeError(f"must be None or an array of integers, got {kind}") from exc
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise TypeError(f"must be None or a 1-D array of integers, got {arr.ndim}-D {arr.dtype}")
    if arr.shape[0] != size + 1:
        m = arr.shape[0]
        raise ValueError(f"has {m} bounds (for {m - 1} ranks), this communicator has {size}")
    arr = arr.astype(np.int64)
    if arr[0] != 0 or bool(np.any(np.diff(arr) < 0)):
        raise ValueError(f"must ascend from 0, got {arr.tolist()}")
    return arr


def _same(a: Any, b: Any) -> bool:
    """Whether two option values are equal (a list and a tuple of equal items are)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # (an array's ambiguous truth value: not an option of ours)
        return False


def check_saved(algo: Any, saved: dict[str, Any], n: int, size: int) -> dict[str, Any]:
    """What restoring ``saved`` (``algo``'s attributes as a checkpoint holds them) writes
    over ``algo``'s attributes: :func:`check_values` of its ``vars`` and ``state_kinds``."""
    return check_values("algorithm", algo.name, vars(algo), algo.state_kinds, saved, n, size)


def check_values(
    what: str,
    name: str,
    own: dict[str, Any],
    kinds: dict[str, Kind] | None,
    saved: dict[str, Any],
    n: int,
    size: int,
) -> dict[str, Any]:
    """What restoring ``saved`` (an object's attributes ``own`` as a checkpoint's
    ``{what}_state`` holds them: the algorithm's or the selection estimator's, called
    ``name``) writes over them: its state, checked by ``kinds`` (see the module docstring);
    raises ValueError or TypeError naming what does not fit, having changed nothing.
    ``kinds`` None (an algorithm registered from outside) checks the attribute names only,
    and all of them are restored as saved."""
    key = f"{what}_state"
    missing = sorted(set(own) - set(saved))
    extra = sorted(set(saved) - set(own))
    if missing or extra:
        parts = [f"lacks {', '.join(missing)}"] if missing else []
        parts += [f"holds {', '.join(extra)}, which {name} here does not have"] if extra else []
        raise ValueError(
            f"the state's {key} {'; '.join(parts)}: not the state of this "
            f"sparsecoll's {name} (saved by another sparsecoll, or by another {what})"
        )
    if kinds is None:
        return copy.deepcopy(saved)
    for attr, value in own.items():
        if attr not in kinds and not _same(saved[attr], value):
            raise ValueError(
                f"the state's {key} has {attr}={saved[attr]!r}, this reducer's "
                f"{name} has {value!r} (the state of another configuration)"
            )
    restored = {}
    for attr, kind in kinds.items():
        try:
            restored[attr] = kind(saved[attr], n, size)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"the state's {key}: {name}'s {attr} {exc}") from None
    return copy.deepcopy(restored)
