"""Plain-numpy selection backend: the same results as the Numba kernels, without Numba.

Used where Numba is missing or disabled (``SPARSECOLL_NO_NUMBA=1``); also the readable
statement of what every backend computes. Works on the same sign-cleared keys as the kernels.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._array import index_dtype
from ._common import NAN_MESSAGE, key_info, key_value, moments_of, threshold_key

__all__ = ["accumulate", "count_ge", "kth_largest_abs", "moments", "threshold", "topk"]


def _keys(x: np.ndarray) -> tuple[np.ndarray, Any]:
    info = key_info(x.dtype)
    keys = x.view(info.utype) & info.utype.type(info.mask)
    if keys.shape[0] and keys.max() > info.inf_key:
        raise ValueError(NAN_MESSAGE)
    return keys, info


def topk(x: np.ndarray, k: int, itype: Any = None) -> tuple[np.ndarray, np.ndarray]:
    n = x.shape[0]
    itype = index_dtype(n) if itype is None else itype
    keys, _ = _keys(x)
    if k == 0 or k == n:
        return np.arange(k, dtype=itype), x[:k].copy()
    kth = np.partition(keys, n - k)[n - k]
    above = keys > kth
    ties = np.flatnonzero(keys == kth)[: k - int(np.count_nonzero(above))]
    above[ties] = True
    idx = np.flatnonzero(above)
    return idx.astype(itype), x[idx]


def kth_largest_abs(x: np.ndarray, k: int) -> float:
    keys, _ = _keys(x)
    n = keys.shape[0]
    return key_value(int(np.partition(keys, n - k)[n - k]), x.dtype)


def threshold(x: np.ndarray, t: float, itype: Any = None) -> tuple[np.ndarray, np.ndarray]:
    itype = index_dtype(x.shape[0]) if itype is None else itype
    keys, _ = _keys(x)
    idx = np.flatnonzero(keys >= threshold_key(t, x.dtype))
    return idx.astype(itype), x[idx]


def count_ge(x: np.ndarray, t: float) -> int:
    keys, _ = _keys(x)
    return int(np.count_nonzero(keys >= threshold_key(t, x.dtype)))


def moments(x: np.ndarray) -> tuple[float, float]:
    mean, std = moments_of(x)
    if mean != mean or std != std:  # NaN in x, or +inf with -inf (a pass only then)
        _keys(x)  # (raises on NaN)
    return mean, std


def accumulate(
    g, r, u, uo, m, acc, z, cut, lo, hi, cap, itype, zero_cut=math.inf, buckets=False,
    workspace=None, nonzeros=False, xp=np,
):  # fmt: skip
    """The fused pass, stated plainly (several passes of ``xp``, numpy or CuPy):
    ``uo = m*u + g`` (when u is given), ``acc = (uo or g) + r`` (r may be None), then the
    entries of ``acc[lo:hi]`` with ``|acc| >= cut`` (none when there are more than cap;
    ``hits`` counts all; those with ``|acc| >= zero_cut`` then zeroed in acc), the
    non-finite count, and ``z`` (when given) zeroed. No histogram of the hits (``buckets``
    is ignored); with ``nonzeros``, the nonzeros of ``acc[lo:hi]`` before that zeroing."""
    src = g
    with np.errstate(over="ignore", invalid="ignore"):  # non-finite results are counted
        if u is not None:
            xp.multiply(u, g.dtype.type(m), out=uo)
            xp.add(uo, g, out=uo)
            src = uo
        if r is not None:
            xp.add(src, r, out=acc)
        else:
            xp.copyto(acc, src)
    if z is not None:
        z[...] = 0
    bad = int(acc.shape[0] - int(xp.count_nonzero(xp.isfinite(acc))))
    part = acc[lo:hi]
    count = int(xp.count_nonzero(part)) if nonzeros else None
    idx = xp.flatnonzero(xp.abs(part) >= part.dtype.type(cut))
    hits = int(idx.shape[0])
    if hits > cap:
        idx = idx[:0]
    vals = part[idx]
    if zero_cut < math.inf:
        part[idx[xp.abs(vals) >= vals.dtype.type(zero_cut)]] = 0
    return (idx + lo).astype(itype), vals, hits, bad, None, count
