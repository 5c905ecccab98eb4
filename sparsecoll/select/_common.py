"""Pieces every selection backend shares: the key view of |x|, threshold rounding, errors.

Selection works on *keys*: the bits of a float with the sign bit cleared, read as an unsigned
integer of the same width. For non-negative floats the bit pattern is monotonic in the value,
so comparing keys compares |x| exactly, in any dtype (float16 included, which Numba cannot do
arithmetic on). +inf has the key ``inf_key``; every NaN has a key above it.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import numpy as np

from .._array import get_array_module, to_host

__all__ = [
    "MOMENT_SCALE",
    "NAN_MESSAGE",
    "SHIFT_SQUARES_EXACT",
    "KeyInfo",
    "key_info",
    "magnitude_ge",
    "magnitude_keys",
    "magnitudes",
    "moment_shift",
    "moments_from_sums",
    "moments_of",
    "round_threshold",
    "shifted_float64",
    "smallest_magnitude",
    "threshold_key",
    "underflowed",
]

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


# On a GPU, CuPy's own ufuncs read float32 subnormals as zeros: CuPy compiles every kernel
# with -ftz=true, so abs, comparisons, min/max, count_nonzero and the cast to float64 become
# abs.ftz.f32, setp.ge.ftz.f32, min.ftz.f32, cvt.ftz.f64.f32 (a subnormal cut meaning
# "nonzero" compared as 0, a vector of subnormals with mean 0). The helpers below work on
# keys, integers that nothing flushes, and give the host's answer on either module.


def magnitude_keys(x: Any) -> Any:
    """The keys of a float array (numpy or CuPy): its bits with the sign bit cleared."""
    info = key_info(x.dtype)
    return x.view(info.utype) & info.utype.type(info.mask)


def magnitudes(x: Any) -> Any:
    """``abs(x)``, subnormals kept on a GPU too."""
    return magnitude_keys(x).view(x.dtype)


def magnitude_ge(x: Any, t: Any) -> Any:
    """The mask ``abs(x) >= t`` with ``t`` taken in x's dtype (rounded to nearest, as
    ``np.abs(x) >= x.dtype.type(t)``): false at NaN, and everywhere for a NaN t."""
    info = key_info(x.dtype)
    keys = magnitude_keys(x)
    ut = info.utype.type
    t = np.array(t, dtype=x.dtype)
    finite_or_inf = keys <= ut(info.inf_key)  # (NaN keys lie above inf's)
    if np.isnan(t):
        return keys > ut(info.mask)  # (nothing)
    if t <= 0:
        return finite_or_inf
    return (keys >= ut(int(t.view(info.utype)))) & finite_or_inf


def smallest_magnitude(x: Any) -> float:
    """``float(abs(x).min())`` for a non-empty x without NaN, subnormals kept on a GPU."""
    return key_value(int(magnitude_keys(x).min()), x.dtype)


def shifted_float64(x: Any, shift: float = 0.0, scale: float = 1.0) -> Any:
    """``x·scale - shift·scale`` in float64 (numpy or CuPy; ``x - shift`` rounded once for
    scale 1). A float32 x on a GPU is widened by a kernel of ours: CuPy's cast flushes its
    subnormals."""
    xp = get_array_module(x)
    if xp is not np and x.dtype == np.float32:
        from ._cupy_kernels import shifted_float64 as on_device

        return on_device(x, shift, scale)
    if scale == 1.0:
        return xp.subtract(x, shift, dtype=np.float64)
    d = xp.multiply(x, scale, dtype=np.float64)
    d -= shift * scale
    return d


# moments are sums of d = x - c for a shift c near the data's centre, not of x: the variance
# as E[x²] - mean² cancels catastrophically where |mean| >> std (a large common offset:
# std came out 0, or wrong by orders of magnitude, e.g. 0 for float32 x around 1e8 with
# std 0.06, and the Gaussian estimators fell back to the exact select). With the shift the
# variance is E[d²] - E[d]², whose rounding is ~eps·(1 + (mean - c)²/std²): c is the middle
# value of a strided sample of SHIFT_SAMPLE entries, near x's median, which lies within a
# std of the mean for any distribution; and c is a value of x, so (mean - c)² <= n·std²
# even for a sample that misleads.
# The sample costs a strided read of a few hundred entries, not a pass.
# A float64 square passes the largest float64 from |d| ~ 1.3e154 on and loses bits
# (subnormal, then 0) below ~1.5e-154. Where the plain sums overflowed, or the squares
# underflowed (mean square below MOMENT_TINY), the values are summed again scaled by a
# power of two (exact): passes only for such data, which otherwise made the Gaussian
# estimators fall back to the exact select. float16/float32 values never need it.
MOMENT_SCALE = 2.0**600  # huge |v| / MOMENT_SCALE: squares finite; tiny |v| x it: normal
MOMENT_TINY = 2.0**-900  # mean square below: redo scaled up
SHIFT_SAMPLE = 255  # entries sampled for the shift


def moment_shift(x: Any) -> float:
    """The shift ``c`` the moment sums are taken around: the middle value (the upper one of
    two) of the finite entries of a strided sample of x (numpy or CuPy; 0.0 when there are
    none), a value of x."""
    n = int(x.shape[0])
    stride = max(1, n // SHIFT_SAMPLE)
    sample = x[stride // 2 :: stride][:SHIFT_SAMPLE]
    sample = to_host(sample)
    sample = sample[np.isfinite(sample)]
    if sample.shape[0] == 0:
        return 0.0
    return float(np.partition(sample, sample.shape[0] // 2)[sample.shape[0] // 2])


def moments_from_sums(
    n: int, a: float, q: float, shift: float = 0.0, scale: float = 1.0
) -> tuple[float, float]:
    """(mean, population std) of n values v from the sums ``a``, ``q`` of d = (v - shift)·scale
    and d² (scale a power of two). Non-finite sums give a non-finite mean or std."""
    mean = a / n
    std = math.sqrt(max(q / n - mean * mean, 0.0)) / scale
    if math.isfinite(a) and math.isfinite(q):  # finite values: std <= half their range,
        std = min(std, sys.float_info.max)  # not inf from a rounding up at the very top
    return shift + mean / scale, std


# |shift| at or above this: every x != shift has (x - shift)² >= the least subnormal, so
# sums a = q = 0 mean x == shift throughout (below it, tiny d = x - shift can square to 0
# and cancel in a)
SHIFT_SQUARES_EXACT = 2.0**-480


def underflowed(x: Any, shift: float, a: float, q: float) -> bool:
    """Whether sums ``a``, ``q`` of d = x - shift and d² come from d so small (mean square
    below MOMENT_TINY, not all zero) that their squares lost bits. Sums both 0 are
    checked against x (a pass) only when x is float64 and |shift| < SHIFT_SQUARES_EXACT:
    all zeros, or subnormal data whose squares vanished and whose d cancelled."""
    if q / int(x.shape[0]) >= MOMENT_TINY:
        return False
    if q != 0.0 or a != 0.0:
        return True
    if x.dtype != np.float64 or abs(shift) >= SHIFT_SQUARES_EXACT:
        return False  # (float16/32 d² never vanish in float64)
    return bool(get_array_module(x).any(x != shift))


def _shifted_sums(x: Any, shift: float, scale: float) -> tuple[float, float]:
    """The sums of d = x·scale - shift·scale and d², d in float64 (one pass to make d)."""
    d = shifted_float64(x, shift, scale)
    return float(d.sum()), float(d.dot(d))


def moments_of(
    x: Any, shift: float | None = None, sums: tuple[float, float] | None = None
) -> tuple[float, float]:
    """(mean, population std) of a float array x of numpy or CuPy, from the sums of
    d = x - shift and d² in float64 (``sums`` if already taken; ``shift`` by default
    :func:`moment_shift`), and, only where those overflowed or the squares underflowed,
    once more scaled."""
    n = int(x.shape[0])
    c = moment_shift(x) if shift is None else shift
    with np.errstate(over="ignore", invalid="ignore"):  # (numpy; rescaled below)
        a, q = sums if sums is not None else _shifted_sums(x, c, 1.0)
        if math.isfinite(a) and math.isfinite(q):
            if not underflowed(x, c, a, q):
                return moments_from_sums(n, a, q, c)
            scale = MOMENT_SCALE
        else:  # an overflow (or non-finite values, which stay so)
            scale = 1.0 / MOMENT_SCALE
        return moments_from_sums(n, *_shifted_sums(x, c, scale), shift=c, scale=scale)
