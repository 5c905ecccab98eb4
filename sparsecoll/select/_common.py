"""Pieces every selection backend shares: the key view of |x|, threshold rounding, errors.

Selection works on *keys*: the bits of a float with the sign bit cleared, read as an unsigned
integer of the same width. For non-negative floats the bit pattern is monotonic in the value,
so comparing keys compares |x| exactly, in any dtype (float16 included, which Numba cannot do
arithmetic on). +inf has the key ``inf_key``; every NaN has a key above it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["NAN_MESSAGE", "KeyInfo", "key_info", "round_threshold", "threshold_key"]

NAN_MESSAGE = "x contains NaN; selection never drops or picks NaN silently"


@dataclasses.dataclass(frozen=True)
class KeyInfo:
    """The key layout of one float dtype."""

    utype: np.dtype  # unsigned integer type of the same width
    bits: int  # significant key bits (width - 1)
    mask: int  # clears the sign bit
    inf_key: int  # key of +inf; NaN keys are larger


_KEYS = {
    2: KeyInfo(np.dtype(np.uint16), 15, 0x7FFF, 0x7C00),
    4: KeyInfo(np.dtype(np.uint32), 31, 0x7FFF_FFFF, 0x7F80_0000),
    8: KeyInfo(np.dtype(np.uint64), 63, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
}


def key_info(dtype: Any) -> KeyInfo:
    """The key layout for float16, float32 or float64."""
    return _KEYS[np.dtype(dtype).itemsize]


def round_threshold(t: float, dtype: Any) -> float:
    """The smallest value of ``dtype`` that is >= ``t`` (0.0 for t <= 0), as a Python float.

    ``|x| >= t`` in exact arithmetic holds iff ``|x| >= round_threshold(t, x.dtype)``, so a
    backend may compare in x's own dtype and still honour a threshold given in float64.
    """
    if t <= 0.0:
        return 0.0
    dt = np.dtype(dtype)
    # (above dtype's largest finite value, both the cast and the step up give inf)
    with np.errstate(over="ignore"):
        r = np.array(t, dtype=np.float64).astype(dt)
        if float(r) < t:
            r = np.nextafter(r, dt.type(np.inf))
    return float(r)


def threshold_key(t: float, dtype: Any) -> int:
    """The smallest key whose value is >= ``t`` (``t`` not NaN)."""
    r = round_threshold(t, dtype)
    return int(np.array(r, dtype=dtype).view(key_info(dtype).utype))


def key_value(key: int, dtype: Any) -> float:
    """The float value of a key (the inverse of taking |x|'s bits)."""
    info = key_info(dtype)
    return float(np.array(key, dtype=info.utype).view(dtype))
