"""Merge sorted sparse runs, summing equal indices: a Numba kernel on the host, coalesce on GPU.

Both inputs of :func:`merge_two` are sorted with unique indices (the coalesced form); the
output is too. One linear pass (about 3× faster than sort-based coalescing of the
concatenation). Equal indices are summed as ``a + b`` (first operand from the first run):
IEEE addition is commutative, so two ranks merging the same pair of runs in either order
get the same bits.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .._array import get_array_module
from ..sparse import coalesce

__all__ = ["accumulate_dtype", "gather", "isin_sorted", "merge_two", "where_at_least"]


def accumulate_dtype(dtype: Any) -> np.dtype:
    """The type sums are accumulated in: float64 for float16 (Numba has no float16, and the sum
    of two float16 values is exact in float64, so it is rounded once), else dtype."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float64) if dtype == np.float16 else dtype


@functools.cache
def _kernel() -> Any:
    import numba

    @numba.njit(cache=True, nogil=True)
    def merge(i1, v1, i2, v2):  # pragma: no cover - compiled
        m1 = i1.shape[0]
        m2 = i2.shape[0]
        idx = np.empty(m1 + m2, i1.dtype)
        val = np.empty(m1 + m2, v1.dtype)
        a = 0
        b = 0
        o = 0
        while a < m1 and b < m2:
            x = i1[a]
            y = i2[b]
            if x < y:
                idx[o] = x
                val[o] = v1[a]
                a += 1
            elif y < x:
                idx[o] = y
                val[o] = v2[b]
                b += 1
            else:
                idx[o] = x
                val[o] = v1[a] + v2[b]
                a += 1
                b += 1
            o += 1
        while a < m1:
            idx[o] = i1[a]
            val[o] = v1[a]
            a += 1
            o += 1
        while b < m2:
            idx[o] = i2[b]
            val[o] = v2[b]
            b += 1
            o += 1
        return idx[:o], val[:o]

    return merge


@functools.cache
def _isin_kernel() -> Any:
    import numba

    @numba.njit(cache=True, nogil=True)
    def isin(a, b, out):  # pragma: no cover - compiled
        # both ascending: one linear walk (b may hold repeats, a too)
        m = b.shape[0]
        j = 0
        for i in range(a.shape[0]):
            x = a[i]
            while j < m and b[j] < x:
                j += 1
            out[i] = j < m and b[j] == x

    return isin


@functools.cache
def _gather_kernel() -> Any:
    import numba

    @numba.njit(cache=True, nogil=True)
    def gather(x, idx, out, drop):  # pragma: no cover - compiled
        for j in range(idx.shape[0]):  # (drop is the same for every j: a predictable branch)
            out[j] = x[idx[j]]
            if drop:
                x[idx[j]] = 0

    return gather


def gather(x: Any, idx: Any, drop: bool = False) -> Any:
    """``x[idx]`` for in-range indices: a Numba loop on the host (numpy's fancy indexing
    took 1.6x as long for 168K scattered entries of a 16M vector), ``x[idx]`` on a GPU.
    With ``drop`` (unique indices only: a repeat would read the 0) the entries read are
    set to 0, in the same loop on the host: the write finds the line that the read just
    brought in."""
    if get_array_module(x) is not np or x.dtype == np.float16:
        out = x[idx]
        if drop:
            x[idx] = 0
        return out
    out = np.empty(idx.shape[0], x.dtype)
    _gather_kernel()(x, np.ascontiguousarray(idx), out, bool(drop))
    return out


@functools.cache
def _at_least_kernels() -> Any:
    import numba

    @numba.njit(cache=True, nogil=True)
    def count(x, t):  # pragma: no cover - compiled
        c = 0
        for i in range(x.shape[0]):
            c += x[i] >= t
        return c

    @numba.njit(cache=True, nogil=True)
    def take(x, t, payload, out):  # pragma: no cover - compiled
        # every payload entry is written at p, and p advances where x >= t: no branch on
        # the data (which entries are taken is data-dependent, a branch mispredicts)
        p = 0
        for i in range(x.shape[0]):
            out[p] = payload[i]
            p += x[i] >= t

    return count, take


def where_at_least(x: Any, t: Any, payload: Any) -> Any:
    """``payload[x >= t]`` (x and payload of one length, t a scalar of x's dtype; NaN never
    selected): a branch-free Numba loop on the host (numpy's boolean indexing was most of
    exdyna's window selection time, docs/benchmarks.md), the boolean index on a GPU."""
    if get_array_module(x) is not np or x.dtype == np.float16:
        return payload[x >= t]
    count, take = _at_least_kernels()
    x = np.ascontiguousarray(x)
    t = x.dtype.type(t)
    m = int(count(x, t))
    out = np.empty(m + 1, payload.dtype)  # the slot past the last taken one is written too
    take(x, t, np.ascontiguousarray(payload), out)
    return out[:m]


def isin_sorted(a: Any, b: Any) -> Any:
    """Boolean mask over the ascending array ``a``: which entries occur in the ascending
    array ``b``. One linear walk on the host (binary searches took ~20 ns an entry), a
    search per entry on a GPU."""
    xp = get_array_module(a)
    if b.shape[0] == 0:
        return xp.zeros(a.shape[0], dtype=bool)
    if xp is np:
        out = np.empty(a.shape[0], dtype=bool)
        _isin_kernel()(np.ascontiguousarray(a), np.ascontiguousarray(b), out)
        return out
    pos = xp.minimum(xp.searchsorted(b, a), b.shape[0] - 1)
    return b[pos] == a


def merge_two(i1: Any, v1: Any, i2: Any, v2: Any, n: int) -> tuple[Any, Any]:
    """Merge two coalesced runs (same index and value dtypes); returns new arrays.

    float16 values are summed in float64 and rounded once (as ``coalesce`` does); the
    result keeps the input dtype.
    """
    if i2.shape[0] == 0:
        return i1.copy(), v1.copy()
    if i1.shape[0] == 0:
        return i2.copy(), v2.copy()
    xp = get_array_module(v1)
    if xp is not np:
        out = coalesce(xp.concatenate([i1, i2]), xp.concatenate([v1, v2]), n)
        return out.indices, out.values
    acc = accumulate_dtype(v1.dtype)
    idx, val = _kernel()(
        np.ascontiguousarray(i1), _aligned(v1, acc), np.ascontiguousarray(i2), _aligned(v2, acc)
    )
    return idx, val.astype(v1.dtype, copy=False)


def _aligned(v: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if v.dtype != dtype or not v.flags.aligned or not v.flags.c_contiguous:
        return np.ascontiguousarray(v.astype(dtype, copy=True))
    return v
