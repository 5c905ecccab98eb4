"""A sparse training step's O(k) end: the entries sent leave the accumulated vector (and the
velocity), and the result is written into the update buffer."""

from __future__ import annotations

from typing import Any

from .._array import get_array_module
from ._steps import numba_host

__all__ = ["finish"]


def finish(
    acc: Any,
    velocity: Any,
    sent: Any,
    update: Any,
    old: Any,
    indices: Any,
    values: Any,
    divisor: int,
    zeroed: Any = None,
    late_zero: bool = False,
    dropped: bool = False,
) -> None:
    """``acc[sent] = 0`` (and ``velocity[sent]``), ``update[old] = 0`` (old may be None),
    then ``update[indices] = values / divisor``.

    With ``zeroed`` (the pass's candidates: indices, values, the cut ``zc`` from which it
    zeroed them in acc, and a mask of those sent, which ``sent`` lists) acc is fixed where
    that zeroing was wrong instead. ``late_zero``: the update was not zeroed; it is written
    whole. ``dropped``: ``acc[sent]`` is 0 already (the collective zeroed it as it read the
    values). One Numba loop on the CPU, numpy/CuPy otherwise.
    """
    if numba_host(acc):
        from ..select._numba_train import finish_step

        finish_step(
            acc, velocity, sent, update, old, indices, values, divisor, zeroed, late_zero,
            dropped,
        )  # fmt: skip
        return
    if zeroed is not None:
        xp = get_array_module(acc)
        cand, cval, zc, taken = zeroed
        back = ~taken & (xp.abs(cval) >= cval.dtype.type(zc))
        acc[cand[back]] = cval[back]
    if not dropped:
        acc[sent] = 0
    if velocity is not None:
        velocity[sent] = 0
    if old is not None:
        update[old] = 0
    if late_zero:
        update[...] = 0
    update[indices] = values / values.dtype.type(divisor) if divisor != 1 else values
