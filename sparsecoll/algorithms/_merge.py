"""Merge sorted sparse runs, summing equal indices: Numba kernels on the host, CuPy on a GPU.

:func:`merge_two` takes two coalesced runs (sorted, unique indices) and returns one, in one
linear pass instead of a sort of the concatenation. Equal indices are summed as ``a + b``;
IEEE addition is commutative, so two ranks merging the same pair of runs in either order
get the same bits. Rows (values of shape ``(m, D)``) merge the same way, equal indices
summed elementwise. :class:`RunStack` merges runs as they arrive (dsa's and hashed's
owners). The other kernels here (gather, take_at_least, keep_bucket, isin_sorted)
are the selecting algorithms' host loops, each with a CuPy fallback.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .._array import get_array_module, index_dtype
from .._jit import cached_njit
from ..select._common import magnitude_ge
from ..sparse import coalesce

__all__ = [
    "RunStack", "accumulate_dtype", "add_sparse", "gather", "isin_sorted", "keep_bucket",
    "merge_at", "merge_two", "take_at_least",
]  # fmt: skip


def accumulate_dtype(dtype: Any) -> np.dtype:
    """Return float64 for float16 (a float16 sum is exact in float64; Numba has no float16)."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float64) if dtype == np.float16 else dtype


def add_sparse(acc: Any, idx: Any, vals: Any, lo: int) -> None:
    """Add a run (unique indices) into the dense ``acc`` that starts at index ``lo``."""
    # unique indices: a fancy-indexed += adds each exactly once
    if idx.shape[0]:
        acc[idx - lo] += vals


@functools.cache
def _kernel() -> Any:
    @cached_njit(nogil=True)
    def merge(i1, v1, i2, v2, idx, val, o):  # pragma: no cover - compiled
        # writes the merged run at idx[o:], val[o:]; returns where it ends
        m1 = i1.shape[0]
        m2 = i2.shape[0]
        a = 0
        b = 0
        while a < m1 and b < m2:
            # without branches on the data (selects), so random interleavings do not stall
            x = i1[a]
            y = i2[b]
            ta = x <= y
            tb = y <= x
            va = v1[a]
            vb = v2[b]
            idx[o] = x if ta else y
            s = va + vb
            val[o] = s if ta and tb else (va if ta else vb)
            a += ta
            b += tb
            o += 1
        r = m1 - a
        idx[o : o + r] = i1[a:]
        val[o : o + r] = v1[a:]
        o += r
        r = m2 - b
        idx[o : o + r] = i2[b:]
        val[o : o + r] = v2[b:]
        o += r
        return o

    return merge


@functools.cache
def _row_kernel() -> Any:
    @cached_njit(nogil=True)
    def merge_rows(i1, v1, i2, v2, idx, val, o):  # pragma: no cover - compiled
        # as merge, a row of D values per index; equal indices add v1's row to v2's
        m1 = i1.shape[0]
        m2 = i2.shape[0]
        d = v1.shape[1]
        a = 0
        b = 0
        while a < m1 and b < m2:
            x = i1[a]
            y = i2[b]
            if x < y:
                idx[o] = x
                for c in range(d):
                    val[o, c] = v1[a, c]
                a += 1
            elif y < x:
                idx[o] = y
                for c in range(d):
                    val[o, c] = v2[b, c]
                b += 1
            else:
                idx[o] = x
                for c in range(d):
                    val[o, c] = v1[a, c] + v2[b, c]
                a += 1
                b += 1
            o += 1
        # the rest of one run (the other is spent), copied whole
        idx[o : o + m1 - a] = i1[a:]
        val[o : o + m1 - a] = v1[a:]
        o += m1 - a
        idx[o : o + m2 - b] = i2[b:]
        val[o : o + m2 - b] = v2[b:]
        o += m2 - b
        return o

    return merge_rows


@functools.cache
def _isin_kernel() -> Any:
    @cached_njit(nogil=True)
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
    @cached_njit(nogil=True)
    def gather(x, idx, out, drop):  # pragma: no cover - compiled
        for j in range(idx.shape[0]):  # drop is the same for every j: a predictable branch
            out[j] = x[idx[j]]
            if drop:
                x[idx[j]] = 0

    return gather


def gather(x: Any, idx: Any, drop: bool = False) -> Any:
    """Return ``x[idx]`` for in-range indices (a Numba loop on the host).

    With ``drop`` (unique indices only: a repeat would read the 0) the entries read are set
    to 0 in the same loop, while their cache line is still in.
    """
    if get_array_module(x) is not np or x.dtype == np.float16:
        out = x[idx]
        if drop:
            x[idx] = 0
        return out
    out = np.empty(idx.shape[0], x.dtype)
    _gather_kernel()(x, np.ascontiguousarray(idx), out, bool(drop))
    return out


@functools.cache
def _take_kernel() -> Any:
    @cached_njit(nogil=True)
    def counts(values, t, zc):  # pragma: no cover - compiled
        m = 0
        z = 0
        for q in range(values.shape[0]):
            v = abs(values[q])
            m += v >= t
            z += v >= zc
        return m, z

    @cached_njit(nogil=True)
    def take(values, t, zc, idx, lo, part, out_idx, out_val, fix):  # pragma: no cover
        # every candidate is written at p, which advances when it is taken: no branch on
        # the data (which are taken is random); with part, those between the two cuts are
        # listed the same way and written after the loop
        p = 0
        f = 0
        for q in range(values.shape[0]):
            v = abs(values[q])
            sel = v >= t
            out_idx[p] = idx[q]
            out_val[p] = values[q]
            p += sel
            if part is not None:  # resolved at compile time
                fix[f] = q
                f += sel != (v >= zc)
        if part is not None:
            for i in range(f):
                q = fix[i]
                part[idx[q] - lo] = 0 if abs(values[q]) >= t else values[q]

    return counts, take


def take_at_least(
    values: Any, t: Any, idx: Any, lo: int = 0, part: Any = None, zc: Any = None
) -> tuple[Any, Any]:
    """Return ``(idx[keep], values[keep])`` where ``keep = |values| >= t`` (NaN never kept).

    ``t`` is a scalar of values' dtype. With ``part`` and ``zc``: ``values`` are those of
    ``part`` at ``idx - lo``, and ``part`` holds 0 where ``|values| >= zc``; ``part`` is then
    fixed to hold 0 exactly where kept (only the entries between the two cuts are written).
    A branch-free Numba loop on the host, boolean indexing on a GPU.
    """
    xp = get_array_module(values)
    t = values.dtype.type(t)
    zc = values.dtype.type(np.inf if zc is None else zc)
    if xp is not np or values.dtype == np.float16:
        keep = magnitude_ge(values, t)  # not abs() >=: CuPy's flushes float32 subnormals
        if part is not None:
            fix = keep != magnitude_ge(values, zc)
            part[idx[fix] - lo] = xp.where(keep[fix], 0, values[fix]).astype(part.dtype)
        return idx[keep], values[keep]
    counts, take = _take_kernel()
    values, idx = np.ascontiguousarray(values), np.ascontiguousarray(idx)
    m, z = counts(values, t, zc)
    out_idx = np.empty(m + 1, idx.dtype)  # the slot past the last one is written too
    out_val = np.empty(m + 1, values.dtype)
    fix = np.empty(abs(m - z) + 1 if part is not None else 1, np.int64)
    take(values, t, zc, idx, np.int64(lo), part, out_idx, out_val, fix)
    return out_idx[:m], out_val[:m]


@functools.cache
def _keep_bucket_kernel() -> Any:
    @cached_njit(nogil=True)
    def keep(idx, values, hi, lo, a1, b1, a2, b2, out_idx, out_val, chosen):  # pragma: no cover
        # every entry is written at p, which advances when it is kept: no branch on
        # whether it is kept (random). The bucket is a thin slice of the magnitudes, so the
        # one branch, on entering it, is rarely taken and well predicted; o counts the
        # bucket so far
        p = 0
        o = 0
        for i in range(values.shape[0]):
            v = abs(values[i])
            keep = v >= hi
            if v >= lo and not keep:
                keep = (a1 <= o < b1) or (a2 <= o < b2)
                o += 1
            out_idx[p] = idx[i]
            out_val[p] = values[i]
            chosen[i] = keep
            p += keep
        return p

    return keep


Runs = tuple[tuple[int, int], ...]


def keep_bucket(
    idx: Any, values: Any, hi: Any, lo: Any, runs: Runs, count: int, mask: bool = False
) -> tuple[Any, ...]:
    """Return the entries with |value| >= hi plus a chosen part of the bucket [lo, hi).

    Of the bucket, in order, the entries at the positions in ``runs`` (at most two
    half-open ``(start, stop)`` ranges) are kept; ``count`` entries in all (the caller
    knows it). ``hi`` and ``lo`` are scalars of values' dtype, lo <= hi. With ``mask``, a
    third array says which entries were kept.
    """
    if len(runs) > 2:
        raise ValueError(f"keep_bucket: at most two runs, got {runs}")
    (a1, b1), (a2, b2) = (*runs, (0, 0), (0, 0))[:2]
    xp = get_array_module(values)
    if xp is not np or values.dtype == np.float16:
        chosen = magnitude_ge(values, hi)  # as in take_at_least
        bucket = xp.flatnonzero(magnitude_ge(values, lo) & ~chosen)
        for a, b in ((a1, b1), (a2, b2)):
            chosen[bucket[max(a, 0) : max(b, 0)]] = True
        kept = idx[chosen], values[chosen]
    else:
        out_idx = np.empty(count + 1, idx.dtype)  # the slot past the last one is written too
        out_val = np.empty(count + 1, values.dtype)
        chosen = np.empty(values.shape[0], dtype=bool)
        dt = values.dtype.type
        got = _keep_bucket_kernel()(
            np.ascontiguousarray(idx), np.ascontiguousarray(values), dt(hi), dt(lo),
            int(a1), int(b1), int(a2), int(b2), out_idx, out_val, chosen,
        )  # fmt: skip
        assert got == count, (got, count)
        kept = out_idx[:count], out_val[:count]
    return (*kept, chosen) if mask else kept


def isin_sorted(a: Any, b: Any) -> Any:
    """Return which entries of the ascending ``a`` occur in the ascending ``b`` (a linear walk)."""
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
    """Merge two coalesced runs (same index and value dtypes, same row width) into new arrays.

    float16 values are summed in float64 and rounded once, as ``coalesce`` does.
    """
    if i2.shape[0] == 0:
        return i1.copy(), v1.copy()
    if i1.shape[0] == 0:
        return i2.copy(), v2.copy()
    xp = get_array_module(v1)
    if xp is not np:
        out = coalesce(xp.concatenate([i1, i2]), xp.concatenate([v1, v2]), n)
        return out.indices, out.values
    m = i1.shape[0] + i2.shape[0]
    idx = np.empty(m, i1.dtype)
    val = np.empty((m, *v1.shape[1:]), accumulate_dtype(v1.dtype))
    o = merge_at(i1, v1, i2, v2, idx, val, 0)
    return idx[:o], val[:o].astype(v1.dtype, copy=False)


def merge_at(i1: Any, v1: Any, i2: Any, v2: Any, idx: Any, val: Any, at: int) -> int:
    """Merge two coalesced host runs into ``idx[at:]``, ``val[at:]`` (room for both runs,
    ``val`` of :func:`accumulate_dtype`); return where the merged run ends."""
    acc = val.dtype
    kernel = _row_kernel() if v1.ndim == 2 else _kernel()
    return int(
        kernel(
            np.ascontiguousarray(i1), _aligned(v1, acc), np.ascontiguousarray(i2),
            _aligned(v2, acc), idx, val, at,
        )
    )  # fmt: skip


def _aligned(v: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if v.dtype != dtype or not v.flags.aligned or not v.flags.c_contiguous:
        return np.ascontiguousarray(v.astype(dtype, copy=True))
    return v


class RunStack:
    """Merge runs as they arrive, binary-counter style: O(m log runs) work, mostly overlapped.

    A run merges with the top of the stack while the top is at most twice its size.
    """

    def __init__(self, n: int, xp: Any, dtype: Any, row: tuple[int, ...] = ()) -> None:
        self.n, self.xp, self.dtype, self.row = n, xp, dtype, row
        self.runs: list[tuple[Any, Any]] = []

    def push(self, idx: Any, vals: Any) -> None:
        if idx.shape[0] == 0:
            return
        run = (idx, vals)
        while self.runs and self.runs[-1][0].shape[0] <= 2 * run[0].shape[0]:
            top = self.runs.pop()
            run = merge_two(top[0], top[1], run[0], run[1], self.n)
        self.runs.append(run)

    def result(self) -> tuple[Any, Any]:
        if not self.runs:
            return self.xp.zeros(0, index_dtype(self.n)), self.xp.zeros((0, *self.row), self.dtype)
        run = self.runs.pop()
        while self.runs:
            top = self.runs.pop()
            run = merge_two(top[0], top[1], run[0], run[1], self.n)
        return run
