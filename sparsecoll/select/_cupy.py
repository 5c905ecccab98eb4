"""Selection on the GPU (CuPy): exact top-k by radix select, threshold selection, counts.

Every function takes a 1-D CuPy float array ``x`` (float16/32/64) and keeps it on the device:
only scalars (counts, the threshold) come back to the host, never the vector.

Order by magnitude uses *keys*: the bits of ``x`` with the sign bit cleared, read as an
unsigned integer of the same width. For IEEE floats the key order is the order of ``|x|``
(``-0.0`` and ``0.0`` share a key; every NaN has a key above ``inf``'s). Every function raises
ValueError when x holds a NaN (the check rides along a pass each makes anyway: a counter in
the first histogram pass, a flag in the threshold-mask kernel).

Top-k is a radix select over 16-bit digits of the key (1 pass for float16, 2 for float32,
4 for float64): each pass builds a 65536-bin histogram of the current digit over the keys
that match the digits fixed so far (one kernel, atomics into global memory), then picks the
digit where the running count from the top reaches k. The final key T is the exact k-th
largest; the result is every index with key > T plus the lowest-index ones with key == T.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from .._array import cupy_or_none, index_dtype

__all__ = ["count_ge", "kth_largest_abs", "moments", "threshold", "topk"]

_UINT = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}
_INF_KEY = {2: 0x7C00, 4: 0x7F80_0000, 8: 0x7FF0_0000_0000_0000}
_DIGIT = 16
_BINS = 1 << _DIGIT


def _nan_error() -> ValueError:
    try:
        from ._common import NAN_MESSAGE
    except ImportError:  # pragma: no cover - before the CPU selection package is present
        NAN_MESSAGE = "x contains NaN; selection never drops or picks NaN silently"
    return ValueError(NAN_MESSAGE)


def _check(x: Any) -> Any:
    if getattr(x, "ndim", None) != 1:
        raise ValueError(f"x must be 1-D, got shape {getattr(x, 'shape', None)}")
    if x.dtype.kind != "f":
        raise TypeError(f"x must be float16, float32 or float64, got {x.dtype}")
    return cupy_or_none().ascontiguousarray(x)


def _bits(x: Any) -> tuple[Any, Any, Any]:
    """(raw bits of x as unsigned ints, the mask that clears the sign bit, the key of inf)."""
    ut = _UINT[x.dtype.itemsize]
    width = 8 * ut.itemsize
    return x.view(ut), ut.type((1 << (width - 1)) - 1), ut.type(_INF_KEY[ut.itemsize])


def _empty(n: int, dtype: Any) -> tuple[Any, Any]:
    cp = cupy_or_none()
    return cp.zeros(0, dtype=index_dtype(n)), cp.zeros(0, dtype=dtype)


@functools.cache
def _hist_kernel(cp: Any) -> Any:
    # hist[digit of key] += 1 for every key whose higher digits equal the prefix so far;
    # hist[65536] counts NaN keys (above inf's). The casts: numpy's uint64 may be
    # "unsigned long", which atomicAdd has no overload for.
    return cp.ElementwiseKernel(
        "U bits, U absmask, U infkey, U pmask, U prefix, int32 shift",
        "raw uint64 hist",
        """
        U key = bits & absmask;
        if ((key & pmask) == prefix) {
            atomicAdd((unsigned long long*)&hist[(int)((key >> shift) & 0xFFFF)], 1ULL);
        }
        if (key > infkey) {
            atomicAdd((unsigned long long*)&hist[65536], 1ULL);
        }
        """,
        "sparsecoll_radix_hist",
    )


@functools.cache
def _ge_kernel(cp: Any) -> Any:
    # m = |x| >= t compared as keys; flag[0] = 1 when some key is a NaN's (a benign race:
    # every writer stores 1).
    return cp.ElementwiseKernel(
        "U bits, U absmask, U infkey, U tkey",
        "bool m, raw int32 flag",
        """
        U key = bits & absmask;
        m = key >= tkey;
        if (key > infkey) flag[0] = 1;
        """,
        "sparsecoll_ge_mask",
    )


def _kth_key(x: Any, k: int) -> tuple[int, int]:
    """(T, need): T the k-th largest key of ``x`` (1 <= k <= x.size), ``need`` how many
    entries with key == T belong to the top k (those with key > T number k - need)."""
    cp = cupy_or_none()
    bits, absmask, infkey = _bits(x)
    ut = bits.dtype.type
    width = 8 * bits.dtype.itemsize
    hist = cp.empty(_BINS + 1, dtype=np.uint64)
    prefix = 0
    pmask = 0
    remaining = k  # how many of the top k lie among the keys matching the prefix
    for shift in range(width - _DIGIT, -1, -_DIGIT):
        hist.fill(0)
        _hist_kernel(cp)(bits, absmask, infkey, ut(pmask), ut(prefix), np.int32(shift), hist)
        if pmask == 0 and int(hist[_BINS]):
            raise _nan_error()
        from_top = cp.cumsum(hist[_BINS - 1 :: -1])  # from_top[j]: keys with digit >= BINS-1-j
        j = int(cp.searchsorted(from_top, cp.asarray([remaining], dtype=np.uint64))[0])
        if j:
            remaining -= int(from_top[j - 1])
        digit = _BINS - 1 - j
        prefix |= digit << shift
        pmask |= (_BINS - 1) << shift
    return prefix, remaining


def topk(x: Any, k: int) -> tuple[Any, Any]:
    """The ``k`` entries of largest ``|x|`` (ties: lower index first), exactly.

    Returns ``(indices, values)``: indices ascending, of ``index_dtype(x.size)``, and
    ``x`` at them; all of ``x`` when ``k >= x.size``, nothing when ``k <= 0``.
    """
    cp = cupy_or_none()
    x = _check(x)
    n = int(x.shape[0])
    k = int(k)
    itype = index_dtype(n)
    if k <= 0 or n == 0:
        _check_nan(x)
        return _empty(n, x.dtype)
    if k >= n:
        _check_nan(x)
        return cp.arange(n, dtype=itype), x.copy()
    t, need = _kth_key(x, k)
    bits, absmask, infkey = _bits(x)
    tt = bits.dtype.type(t)
    idx = cp.flatnonzero(_key_mask(bits, absmask, infkey, tt))
    if idx.shape[0] > k:  # more ties at T than fit: keep the first `need` of them
        tie = (bits[idx] & absmask) == tt
        idx = idx[~tie | (cp.cumsum(tie) <= need)]
    idx = idx.astype(itype, copy=False)
    return idx, x[idx]


def _at_least(t: float, dtype: Any) -> Any:
    """The smallest value of ``dtype`` that is >= t, so ``|x| >= t`` can be tested in
    ``dtype`` without rounding changing the answer (-inf when every |x| qualifies)."""
    dtype = np.dtype(dtype)
    t = float(t)
    if t <= 0:
        return dtype.type(-np.inf)
    with np.errstate(over="ignore"):
        v = dtype.type(t)
    if float(v) < t:
        v = np.nextafter(v, dtype.type(np.inf))
    return v


def _check_nan(x: Any) -> None:
    if x.shape[0] and bool(cupy_or_none().isnan(x).any()):
        raise _nan_error()


def _ge_mask(x: Any, t: float) -> Any:
    """The mask ``|x| >= t`` (exact for a float64 t); raises on NaN in x or t."""
    t = float(t)
    if t != t:
        raise ValueError("the threshold is NaN")
    bits, absmask, infkey = _bits(x)
    tv = _at_least(t, x.dtype)
    tkey = bits.dtype.type(0) if tv < 0 else np.array(tv, dtype=x.dtype).view(bits.dtype)[()]
    return _key_mask(bits, absmask, infkey, tkey)


def _key_mask(bits: Any, absmask: Any, infkey: Any, tkey: Any) -> Any:
    """The mask ``key >= tkey`` in one pass; raises if some key is a NaN's."""
    cp = cupy_or_none()
    mask = cp.empty(bits.shape[0], dtype=np.bool_)
    flag = cp.zeros(1, dtype=np.int32)
    if bits.shape[0]:
        _ge_kernel(cp)(bits, absmask, infkey, tkey, mask, flag)
        if int(flag[0]):
            raise _nan_error()
    return mask


def threshold(x: Any, t: float) -> tuple[Any, Any]:
    """Every entry with ``|x| >= t``: ``(indices ascending, values)``."""
    x = _check(x)
    idx = cupy_or_none().flatnonzero(_ge_mask(x, t)).astype(index_dtype(x.shape[0]), copy=False)
    return idx, x[idx]


def count_ge(x: Any, t: float) -> int:
    """How many entries have ``|x| >= t``."""
    x = _check(x)
    return int(cupy_or_none().count_nonzero(_ge_mask(x, t)))


def moments(x: Any) -> tuple[float, float]:
    """(mean, population std) of x, accumulated in float64 (scaled where the squares
    would pass float64's range); raises on NaN."""
    x = _check(x)
    n = int(x.shape[0])
    if n == 0:
        raise ValueError("moments of an empty vector")
    from ._common import moments_of

    mean, std = moments_of(x)  # (sums of x - shift: see _common.moment_shift)
    if mean != mean or std != std:
        _check_nan(x)
    return mean, std


def kth_largest_abs(x: Any, k: int) -> float:
    """The k-th largest ``|x|`` (1-based; k is clipped to [1, x.size]); 0.0 for empty x.

    ``count_ge(x, kth_largest_abs(x, k)) >= k``, with equality unless there are ties.
    """
    x = _check(x)
    n = int(x.shape[0])
    if n == 0:
        return 0.0
    t, _ = _kth_key(x, min(max(int(k), 1), n))
    return float(np.array([t], dtype=_UINT[x.dtype.itemsize]).view(x.dtype)[0])


@functools.cache
def _accumulate_kernel(cp: Any, has_r: bool, has_u: bool) -> Any:
    # One pass: uo = m*u + g (momentum), acc = (uo or g) + r, sel = |acc| >= cut, and
    # bad[0] counts non-finite acc. One kernel per combination of the optional inputs, so
    # absent ones are never read.
    ins = ["T g"] + (["T r"] if has_r else []) + (["T u", "T m"] if has_u else []) + ["T cut"]
    outs = ["T acc"] + (["T uo"] if has_u else []) + ["bool sel", "raw uint64 bad"]
    body = "T v = g;\n"
    if has_u:
        body += "v = m * u + g; uo = v;\n"
    if has_r:
        body += "v = v + r;\n"
    body += """
        acc = v;
        sel = abs(v) >= cut;
        if (!isfinite(v)) atomicAdd((unsigned long long*)&bad[0], 1ULL);
    """
    # --fmad=false: m*u + g rounded twice, as numpy and the CPU pass do (a fused
    # multiply-add rounds once: 1 ulp off the CPU's result, seen on an H100)
    return cp.ElementwiseKernel(
        ", ".join(ins), ", ".join(outs), body, "sparsecoll_accumulate", options=("--fmad=false",)
    )


def accumulate(
    g, r, u, uo, m, acc, z, cut, lo, hi, cap, itype, zero_cut=math.inf, buckets=False,
    workspace=None, nonzeros=False,
):  # fmt: skip
    """The fused pass on the GPU: one elementwise kernel, then the selection's indices
    (see ``sparsecoll.select.accumulate``; no histogram of the hits, no workspace)."""
    cp = cupy_or_none()
    if g.dtype == np.float16:  # plain CuPy ufuncs: several passes, no half-precision kernel
        from . import _numpy

        return _numpy.accumulate(
            g, r, u, uo, m, acc, z, cut, lo, hi, cap, itype, zero_cut, nonzeros=nonzeros, xp=cp
        )
    n = int(g.shape[0])
    dt = g.dtype.type
    sel = cp.empty(n, dtype=np.bool_)
    bad = cp.zeros(1, dtype=np.uint64)
    args = [g] + ([r] if r is not None else []) + ([u, dt(m)] if u is not None else [])
    outs = [acc] + ([uo] if u is not None else []) + [sel, bad]
    if n:
        _accumulate_kernel(cp, r is not None, u is not None)(*args, dt(cut), *outs)
    idx = cp.flatnonzero(sel[lo:hi])
    if z is not None:
        z.fill(0)
    hits = int(idx.shape[0])
    idx = (idx[: cap if hits <= cap else 0] + lo).astype(itype, copy=False)
    vals = acc[idx]
    count = int(cp.count_nonzero(acc[lo:hi])) if nonzeros else None
    if zero_cut < math.inf:
        acc[idx[cp.abs(vals) >= dt(zero_cut)]] = 0
    return idx, vals, hits, int(bad[0]), None, count
