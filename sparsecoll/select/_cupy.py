"""Selection on the GPU (CuPy): exact top-k by radix select, threshold selection, counts.

Every function takes a 1-D CuPy float array ``x`` (float16/32/64) and keeps it on the device:
only scalars, and the 4096 counters of a histogram, come back to the host, never the vector.

Order by magnitude uses *keys*: the bits of ``x`` with the sign bit cleared, read as an
unsigned integer of the same width. For IEEE floats the key order is the order of ``|x|``
(``-0.0`` and ``0.0`` share a key; every NaN has a key above ``inf``'s). Every function raises
ValueError when x holds a NaN (the check rides along a pass each makes anyway: a counter in
the first histogram pass, a flag in the counting pass of a compaction).

Top-k is a radix select over 12-bit digits of the key, from the top: a pass builds a
4096-bin histogram of the next digit over the keys matching the digits fixed so far (each
block counts into shared memory, then adds its counts to the global histogram). The digit
where the running count from the top reaches k fixes the next 12 bits. Once the keys in
that bin are few, they are gathered with their indices and sorted: that gives the exact
k-th largest key T and, among the keys equal to T, the index of the last one kept (ties go
to the lower index). A float32 top-k is then one histogram pass, one gather pass and a
compaction; on skewed data, one more histogram pass per 12 bits. A bin still large at the
last digit holds one key, T itself (millions of ties): nothing is gathered then, and the
last tie kept is found by counting the ties per tile.

Compaction (the selected indices in ascending order, with their values) is two passes: one
counts the hits of each tile of 4096 entries, a prefix sum of those counts gives each tile
its place in the output, and the second pass writes each tile's hits there (each thread
takes 16 consecutive entries; a block-wide scan of the threads' counts orders them).
``cupy.flatnonzero`` instead writes a mask, then scans it in 64-bit integers. For a
float16/float32 top-k the pass that gathers the k-th key's bin also counts each tile's
keys above that bin, so the histogram is the only wait for the host.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from .._array import cupy_or_none, index_dtype, nonzero_count
from ._common import NAN_MESSAGE, magnitude_ge, moments_of, threshold_key
from ._cupy_kernels import BINS, BLOCK, DIGIT, HIST_BLOCK, TILE, accumulate_kernel, kernel
from ._numpy import accumulate as accumulate_in_passes

__all__ = ["count_ge", "kth_largest_abs", "moments", "threshold", "topk"]

_UINT = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}
_INF_KEY = {2: 0x7C00, 4: 0x7F80_0000, 8: 0x7FF0_0000_0000_0000}
_CANDIDATES = 1 << 21  # gather a bin's keys and sort them once it holds at most this many


@functools.cache
def _grid_cap(cp: Any) -> int:
    """Blocks of a grid-stride pass: enough to fill every multiprocessor."""
    try:
        sms = int(cp.cuda.Device().attributes["MultiProcessorCount"])
    except Exception:  # (the fake CuPy in CI has no device attributes)
        sms = 132
    return 4 * sms


def _nan_error() -> ValueError:
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


def _histogram(bits: Any, absmask: Any, infkey: Any, pmask: int, prefix: int, shift: int):
    """The 4096-bin histogram of the digit at ``shift`` over the keys that match ``prefix``
    under ``pmask``, with the NaN count last, on the host (numpy uint64)."""
    cp = cupy_or_none()
    ut = bits.dtype.type
    n = int(bits.shape[0])
    hist = cp.zeros(BINS + 1, dtype=np.uint64)
    args = (bits, np.int64(n), absmask, infkey, ut(pmask), ut(prefix), np.int32(shift), hist)
    kernel(cp, "sc_hist", bits.dtype.itemsize)((_stride_grid(n),), (HIST_BLOCK,), args)
    return hist.get()


def _stride_grid(n: int) -> int:
    """Blocks of ``HIST_BLOCK`` threads for a grid-stride pass over n entries."""
    return max(1, min(-(-n // HIST_BLOCK), _grid_cap(cupy_or_none())))


def _bin_of(hist: Any, remaining: int) -> tuple[int, int, int]:
    """``(digit, remaining, in_bin)``: the bin of the histogram where the running count
    from the top reaches ``remaining``, how many of those lie in it, and its count."""
    from_top = np.cumsum(hist[BINS - 1 :: -1])  # [j]: keys with digit >= BINS-1-j
    j = int(np.searchsorted(from_top, remaining))
    if j:
        remaining -= int(from_top[j - 1])
    digit = BINS - 1 - j
    return digit, remaining, int(hist[digit])


def _cut(x: Any, k: int, early: bool, index: bool = True) -> tuple[int, int]:
    """``(hi, icut)`` for ``1 <= k <= x.size``: the top k of ``x`` are the entries with
    key > hi, then those with key == hi and index <= icut (``icut = x.size``: all of them),
    and ``hi`` is the exact k-th largest key unless ``early``: then it may be the lowest key
    of a digit bin that the top k take whole (the same entries, found sooner). Without
    ``index`` only ``hi`` is wanted (icut may be x.size however many are tied)."""
    cp = cupy_or_none()
    bits, absmask, infkey = _bits(x)
    ut = bits.dtype.type
    n = int(x.shape[0])
    key_bits = 8 * bits.dtype.itemsize - 1
    full = (1 << key_bits) - 1
    prefix = pmask = 0
    remaining = k  # how many of the top k lie among the keys matching the prefix
    shift = key_bits
    while True:
        shift = max(shift - DIGIT, 0)
        hist = _histogram(bits, absmask, infkey, pmask, prefix, shift)
        if pmask == 0 and hist[BINS]:
            raise _nan_error()
        digit, remaining, in_bin = _bin_of(hist, remaining)
        prefix |= digit << shift
        pmask = (pmask | ((BINS - 1) << shift)) & full
        if early and remaining == in_bin:  # the bin is taken whole: every key >= its lowest
            return prefix, n
        if shift == 0 or in_bin <= _CANDIDATES:
            break
    if shift == 0:  # every key of the bin is `prefix`: the first `remaining` are kept
        if remaining == in_bin or not index:
            return prefix, n
        return prefix, _nth_tie(x, prefix, remaining)
    # the keys of the bin, sorted: the remaining-th largest is the k-th largest overall
    ckey = cp.empty(in_bin, dtype=bits.dtype)
    cidx = cp.empty(in_bin, dtype=np.int64)
    count = cp.zeros(1, dtype=np.uint64)
    args = (bits, np.int64(n), absmask, ut(pmask), ut(prefix), ckey, cidx, count)
    kernel(cp, "sc_gather", bits.dtype.itemsize)((_stride_grid(n),), (HIST_BLOCK,), args)
    skey = cp.sort(ckey)
    t = skey[in_bin - remaining : in_bin - remaining + 1]
    ends = [cp.searchsorted(skey, t, side=side).astype(np.uint64) for side in ("left", "right")]
    lo, hi_pos, tval = (int(v) for v in cp.concatenate([*ends, t.astype(np.uint64)]).get())
    need = remaining - (in_bin - hi_pos)  # of the keys equal to T, how many are kept
    if need == hi_pos - lo:
        return tval, n
    tied = cp.sort(cidx[ckey == ut(tval)])
    return tval, int(tied[need - 1])


def _nth_tie(x: Any, key: int, nth: int) -> int:
    """The index of the ``nth`` entry (1-based, in index order) whose key is ``key``.

    Two counting passes give each tile's keys >= key and > key, so its ties; only the
    tile where their running count reaches nth is searched. Gathering the ties instead
    and sorting them cost 12 bytes and two sorts per tie: ~1.2 GB for 100M equal floats.
    """
    cp = cupy_or_none()
    n = int(x.shape[0])
    ge = _count(x, _device_cut(key, n))[0]
    gt = _count(x, _device_cut(key, -1))[0]
    ends = cp.cumsum(ge.astype(np.int64) - gt.astype(np.int64))
    b = int(cp.searchsorted(ends, cp.asarray(np.array([nth], dtype=np.int64)))[0])
    before = int(ends[b - 1]) if b else 0
    bits, absmask, _ = _bits(x)
    tile = bits[b * TILE : (b + 1) * TILE].get() & absmask
    return b * TILE + int(np.flatnonzero(tile == key)[nth - before - 1])


def _device_cut(hi: int, icut: int) -> Any:
    return cupy_or_none().asarray(np.array([hi, icut], dtype=np.int64))


def _count(x: Any, cut: Any) -> tuple[Any, Any, int]:
    """The counting pass of :func:`_compact`: ``(counts per tile, their running sums,
    the total)``; raises if some entry is a NaN."""
    cp = cupy_or_none()
    bits, absmask, infkey = _bits(x)
    n = int(x.shape[0])
    tiles = -(-n // TILE)
    counts = cp.empty(tiles, dtype=np.uint32)
    flag = cp.zeros(1, dtype=np.uint64)
    args = (bits, np.int64(n), absmask, infkey, cut, counts, flag)
    kernel(cp, "sc_count", bits.dtype.itemsize)((tiles,), (BLOCK,), args)
    ends = cp.cumsum(counts, dtype=np.uint64)
    total, nan = (int(v) for v in cp.concatenate([ends[-1:], flag]).get())
    if nan:
        raise _nan_error()
    return counts, ends, total


def _write(x: Any, cut: Any, counts: Any, ends: Any, total: int) -> tuple[Any, Any]:
    """The writing pass of :func:`_compact`."""
    cp = cupy_or_none()
    bits, absmask, _ = _bits(x)
    itype = index_dtype(x.shape[0])
    idx = cp.empty(total, dtype=itype)
    vals = cp.empty(total, dtype=x.dtype)
    if total:
        args = (bits, np.int64(x.shape[0]), absmask, cut, ends, counts, idx, vals.view(bits.dtype))
        tiles = int(counts.shape[0])
        kernel(cp, "sc_write", bits.dtype.itemsize, itype.itemsize)((tiles,), (BLOCK,), args)
    return idx, vals


def _compact(x: Any, hi: int, icut: int) -> tuple[Any, Any]:
    """``(indices ascending, values)`` of the entries with key > hi, or key == hi and
    index <= icut; raises if some entry is a NaN."""
    if x.shape[0] == 0:
        return _empty(0, x.dtype)
    cut = _device_cut(hi, icut)
    counts, ends, total = _count(x, cut)
    return _write(x, cut, counts, ends, total)


def _topk_packed(x: Any, k: int) -> tuple[Any, Any] | None:
    """Top-k of a float16/float32 ``x`` (n <= 2^32) with one wait for the host: a histogram
    pass, then a pass that counts each tile's keys above the k-th key's bin and gathers the
    bin's keys packed with their indices, a sort of those, and the writing pass. None when
    the bin holds too many keys (skewed or tied data): the general path refines first."""
    cp = cupy_or_none()
    bits, absmask, infkey = _bits(x)
    n = int(x.shape[0])
    key_bits = 8 * bits.dtype.itemsize - 1
    shift = max(key_bits - DIGIT, 0)
    hist = _histogram(bits, absmask, infkey, 0, 0, shift)
    if hist[BINS]:
        raise _nan_error()
    digit, remaining, in_bin = _bin_of(hist, k)
    if in_bin > _CANDIDATES:
        return None
    ut = bits.dtype.type
    tiles = -(-n // TILE)
    cand = cp.empty(in_bin, dtype=np.uint64)
    ncand = cp.zeros(1, dtype=np.uint64)
    counts = cp.empty(tiles, dtype=np.uint32)
    pmask = ((BINS - 1) << shift) & ((1 << key_bits) - 1)
    args = (bits, np.int64(n), absmask, ut(pmask), ut(digit << shift), cand, ncand, counts)
    kb = bits.dtype.itemsize
    kernel(cp, "sc_gather_packed", kb)((tiles,), (BLOCK,), args)
    cand.sort()
    cut = cp.empty(2, dtype=np.int64)
    grid = -(-remaining // BLOCK)
    kernel(cp, "sc_take_packed", kb)(
        (grid,), (BLOCK,), (cand, np.int64(remaining), absmask, counts, cut)
    )
    ends = cp.cumsum(counts, dtype=np.uint64)
    return _write(x, cut, counts, ends, k)


def flatnonzero_mask(mask: Any) -> Any:
    """``cupy.flatnonzero`` of a contiguous bool vector, as indices of ``index_dtype``: two
    passes over the bytes instead of a 64-bit scan."""
    cp = cupy_or_none()
    n = int(mask.shape[0])
    itype = index_dtype(n)
    tiles = -(-n // TILE)
    if tiles == 0:
        return cp.zeros(0, dtype=itype)
    counts = cp.empty(tiles, dtype=np.uint32)
    kernel(cp, "sc_mask_count", 4, itype.itemsize)((tiles,), (BLOCK,), (mask, np.int64(n), counts))
    ends = cp.cumsum(counts, dtype=np.uint64)
    idx = cp.empty(int(ends[-1]), dtype=itype)
    if idx.shape[0]:
        kernel(cp, "sc_mask_write", 4, itype.itemsize)(
            (tiles,), (BLOCK,), (mask, np.int64(n), ends, counts, idx)
        )
    return idx


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
    got = _topk_packed(x, k) if x.dtype.itemsize <= 4 and n <= 1 << 32 else None
    if got is None:
        got = _compact(x, *_cut(x, k, early=True))
    idx, vals = got
    if idx.shape[0] != k:  # pragma: no cover - a broken kernel, not bad input
        raise RuntimeError(f"top-k selected {idx.shape[0]} entries, not k = {k}")
    return idx, vals


def _check_nan(x: Any) -> None:
    if x.shape[0] and bool(cupy_or_none().isnan(x).any()):
        raise _nan_error()


def _threshold_key(x: Any, t: float) -> int:
    """The key k with ``|x| >= t`` exactly when key >= k (exact for a float64 t)."""
    t = float(t)
    if t != t:
        raise ValueError("the threshold is NaN")
    return threshold_key(t, x.dtype)


def threshold(x: Any, t: float) -> tuple[Any, Any]:
    """Every entry with ``|x| >= t``: ``(indices ascending, values)``."""
    x = _check(x)
    return _compact(x, _threshold_key(x, t), x.shape[0])


def count_ge(x: Any, t: float) -> int:
    """How many entries have ``|x| >= t``."""
    x = _check(x)
    tkey = _threshold_key(x, t)
    return _count(x, _device_cut(tkey, x.shape[0]))[2] if x.shape[0] else 0


def moments(x: Any) -> tuple[float, float]:
    """(mean, population std) of x, accumulated in float64 (scaled where the squares
    would pass float64's range); raises on NaN."""
    x = _check(x)
    n = int(x.shape[0])
    if n == 0:
        raise ValueError("moments of an empty vector")
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
    t, _ = _cut(x, min(max(int(k), 1), n), early=False, index=False)
    return float(np.array([t], dtype=_UINT[x.dtype.itemsize]).view(x.dtype)[0])


def accumulate(
    g, r, u, uo, m, acc, z, cut, lo, hi, cap, itype, zero_cut=math.inf, buckets=False,
    workspace=None, nonzeros=False,
):  # fmt: skip
    """The fused pass on the GPU: one elementwise kernel, then the selection's indices
    (see ``sparsecoll.select.accumulate``; no histogram of the hits, no workspace)."""
    cp = cupy_or_none()
    if g.dtype == np.float16:  # plain CuPy ufuncs: several passes, no half-precision kernel
        return accumulate_in_passes(
            g, r, u, uo, m, acc, z, cut, lo, hi, cap, itype, zero_cut, nonzeros=nonzeros, xp=cp
        )
    n = int(g.shape[0])
    dt = g.dtype.type
    sel = cp.empty(n, dtype=np.bool_)
    bad = cp.zeros(1, dtype=np.uint64)
    args = [g] + ([r] if r is not None else []) + ([u, dt(m)] if u is not None else [])
    outs = [acc] + ([uo] if u is not None else []) + [sel, bad]
    if n:
        accumulate_kernel(cp, r is not None, u is not None)(*args, dt(cut), *outs)
    idx = flatnonzero_mask(sel[lo:hi])
    if z is not None:
        z.fill(0)
    hits = int(idx.shape[0])
    idx = idx[: cap if hits <= cap else 0].astype(itype, copy=False) + np.dtype(itype).type(lo)
    vals = acc[idx]
    # (not cupy.count_nonzero nor abs/>=: they read float32 subnormals as 0)
    count = nonzero_count(acc[lo:hi]) if nonzeros else None
    if zero_cut < math.inf:
        acc[idx[magnitude_ge(vals, zero_cut)]] = 0
    return idx, vals, hits, int(bad[0]), None, count
