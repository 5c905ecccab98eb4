"""A GradientReducer's checkpoint format: what state_dict() holds, and the check of a saved
state before it is loaded.

A state is a dict of plain objects and host numpy arrays, of format ``version``
STATE_VERSION: the reducer's identity (the arguments a state must agree on to be loaded,
:data:`MISMATCH` says why for some), ``steps``, ``residual`` and ``velocity`` (n finite
values of the gradients' dtype, or None), the algorithm's and the selection estimator's
state with their versions, the exact top-k's predicted cut (``topk_state``) and the
statistics. :func:`read_state` refuses a state the reducer cannot take (ValueError,
TypeError) before anything changes, and returns what loading assigns.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from .._array import as_array, to_host
from .._options import integer, real
from .._state import check_values
from ..algorithms.base import Algorithm
from ..comm import CommStats
from ..sparse import VALUE_DTYPES
from ._config import selection_version
from ._steps import PREDICTION, slot_values

__all__ = ["STATE_VERSION", "host_copy", "read_state"]

STATE_VERSION = 1
# what every state_dict() holds (the identity's other keys may be absent: see read_state)
STATE_KEYS = (
    "n", "algorithm", "steps", "residual", "algorithm_state", "selection_state", "totals",
    "density_sum", "sparse_steps",
)  # fmt: skip
# why a checkpoint saved with another value of these is refused (given the saved value)
MISMATCH = {
    "error_feedback": lambda saved: (
        "its residual is the error-feedback memory, which this reducer would drop"
        if saved
        else "its residual is what its last step dropped, not a memory to add to the next"
    ),
    "average": lambda saved: "the updates would change scale by the number of ranks",
    "rank": lambda saved: (
        "each rank restores the state it saved: one rank's on every rank would count its "
        "residual on each and lose the others'"
    ),
}


def read_state(
    state: Any,
    *,
    identity: dict[str, Any],
    algorithm: Algorithm,
    selector: Any,
    prediction: dict[str, Any],
    size: int,
) -> dict[str, Any]:
    """What loading ``state`` assigns, checked against the reducer's ``identity`` (the
    arguments a state is saved with), its ``algorithm`` instance, its estimator
    (``selector``, None for the exact selection) and its cut ``prediction``; arrays copied.
    Raises ValueError or TypeError on a state the reducer cannot take. A key of the
    identity absent from the state (saved before it was recorded) is taken as the
    reducer's."""
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
    version = state.get("version")
    if version is None:
        raise ValueError("state holds no format version: not a GradientReducer state_dict()")
    if version != STATE_VERSION:
        raise ValueError(
            f"state is of format version {version!r}, this sparsecoll reads version "
            f"{STATE_VERSION} (saved by another sparsecoll)"
        )
    missing = [key for key in STATE_KEYS if key not in state]
    if missing:
        raise ValueError(
            f"state lacks {', '.join(missing)}: not a whole GradientReducer state_dict()"
        )
    for key, value in identity.items():
        if key in state and state[key] != value:
            saved = state[key]
            if isinstance(value, dict) and isinstance(saved, dict):  # (options: by name)
                names = sorted(o for o in {*saved, *value} if saved.get(o) != value.get(o))
                saved = {o: saved.get(o) for o in names}
                value = {o: value.get(o) for o in names}
            why = MISMATCH.get(key)
            why = "" if why is None else f" ({why(saved)})"
            raise ValueError(f"state is for {key}={saved!r}, this reducer has {value!r}{why}")
    n, momentum = identity["n"], identity["momentum"]
    steps = integer("the state's steps", state["steps"], 0)
    residual = _saved_vector(state, "residual", n)
    velocity = _saved_vector(state, "velocity", n)
    if residual is not None and velocity is not None and residual.dtype != velocity.dtype:
        raise ValueError(
            f"the state's residual is {residual.dtype}, its velocity {velocity.dtype}: a "
            f"state_dict() holds both in its gradients' dtype"
        )
    if velocity is not None and not momentum:
        raise ValueError("state holds a momentum-correction velocity, this reducer has none")
    if velocity is None and momentum and steps and "momentum" not in state:
        # (saved without momentum recorded: with momentum, every step leaves a velocity)
        raise ValueError(
            f"state holds no momentum-correction velocity after {steps} steps (saved "
            f"without momentum), this reducer has momentum={momentum}"
        )
    for key in ("algorithm_state", "selection_state", "totals"):
        if not isinstance(state[key], dict):
            raise TypeError(f"the state's {key} must be a dict, got {type(state[key]).__name__}")
    _check_version(state, "algorithm", algorithm.name, algorithm.state_version)
    algorithm_state = algorithm.check_state(state["algorithm_state"], n, size)
    selection = identity["selection"]
    _check_version(state, "selection", selection, selection_version(selection))
    kinds = {} if selector is None else selector.state_kinds
    own = slot_values(selector)
    selection_state = check_values(
        "selection", selection, own, kinds, state["selection_state"], n, size
    )
    topk_state = state.get("topk_state")
    if topk_state is None:  # (saved before it was kept: this reducer's fresh prediction)
        topk_state = prediction
    elif not isinstance(topk_state, dict):
        raise TypeError(f"the state's topk_state must be a dict, got {type(topk_state).__name__}")
    else:
        topk_state = check_values(
            "topk", "exact top-k", prediction, PREDICTION, topk_state, n, size
        )
    try:
        totals = CommStats(**state["totals"])
    except TypeError as exc:  # (a field this sparsecoll does not count)
        raise ValueError(f"the state's totals: {exc}") from None
    return {
        "steps": steps,
        "residual": residual,
        "velocity": velocity,
        "algorithm_state": algorithm_state,
        "selection_state": selection_state,
        "topk_state": topk_state,
        "totals": totals,
        "density_sum": real("the state's density_sum", state["density_sum"]),
        "sparse_steps": integer("the state's sparse_steps", state["sparse_steps"], 0),
    }


def _saved_vector(state: dict[str, Any], key: str, n: int) -> np.ndarray | None:
    """The state's ``key`` (its residual or velocity) as a new host array of n finite
    float16/32/64 values, from any array library and device; None if the state holds
    none."""
    value = state.get(key)
    if value is None:
        return None
    arr, _ = as_array(value, f"the state's {key}")
    arr = np.array(to_host(arr), copy=True).reshape(-1)
    if arr.dtype not in VALUE_DTYPES or arr.size != n:
        raise ValueError(
            f"the state's {key} must hold n={n} float16, float32 or float64 values, "
            f"got {arr.size} of {arr.dtype}"
        )
    if not np.isfinite(arr).all():  # (no step leaves one: every later step would fail)
        raise ValueError(f"the state's {key} holds NaN or Inf")
    return arr


def _check_version(state: dict[str, Any], what: str, name: str, version: int) -> None:
    """Refuse a state whose ``{what}_state`` (``name``'s) is of another version than
    ``version`` (a state saved before these were versioned holds the first)."""
    saved = state.get(f"{what}_version", 1)
    if saved != version:
        raise ValueError(
            f"the state's {what}_state is {name}'s state version {saved!r}, this sparsecoll's "
            f"{name} reads version {version} (saved by another sparsecoll: load it with a "
            f"fresh reducer's {what}_state and {what}_version to keep its residual)"
        )


def host_copy(obj: Any) -> Any:
    """A deep copy with device arrays moved to the host (numpy)."""
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    if hasattr(obj, "__cuda_array_interface__"):
        return to_host(obj).copy()
    return copy.deepcopy(obj)
