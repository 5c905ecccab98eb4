"""CPU selection kernels in Numba: chunked count / prefix-scan / scatter, and radix select.

Every kernel reads the unsigned-integer view of x and masks the sign bit (see ``_common``), so
the same code serves float16, float32 and float64 and compares |x| exactly.

* threshold: a strided sample of 16 Ki keys estimates how many keys qualify; each chunk of x
  gets that share of the output (plus a margin) and one parallel pass scatters indices and
  values into it, counting NaNs on the way; the chunks' pieces are then concatenated. A
  chunk that overflows its room still counts its hits, and a second pass scatters again
  into exactly sized room. Keys are tested 8 at a time into bit masks (LLVM vector code),
  and the copy loop visits only a 64-key word's set bits.
* top-k: the sample also gives a key that probably has a little more than k keys at or
  above it; one such scatter collects those candidates in index order and checks there are
  at least k (and at most n/2). The exact k-th largest key is then found by radix select
  (histograms of 8/11/16-bit digits, most significant first) over the candidates only, and
  a count/scatter over them applies the tie rule (keys above the k-th, then the
  lowest-indexed keys equal to it). When the sample misleads (too few or too many
  candidates) the same radix select runs over the whole array: slower, same result.

Inputs are validated by ``sparsecoll.select``: x is a contiguous 1-D float16/32/64 array,
1 <= k <= n where noted, t a float that is not NaN. Threads and chunks: ``_numba_core``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from llvmlite import ir
from numba import prange
from numba import types as nbtypes
from numba.extending import intrinsic

from .._array import index_dtype
from ._common import (
    NAN_MESSAGE,
    key_value,
    moment_shift,
    moments_from_sums,
    moments_of,
    threshold_key,
)
from ._numba_core import CHUNKS_PER_THREAD, _bounds, _ctz, _kernels, _keys, _run, _u

__all__ = ["count_ge", "kth_largest_abs", "moments", "threshold", "topk"]

# Tunables (tests lower them to reach every code path on small arrays).
PREFILTER_MIN_N = 1 << 16  # below this, radix select runs on x directly
SAMPLE_SIZE = 1 << 14  # keys sampled to place the candidate cut
BLOCK = 32  # keys per block tested before the scatter loops copy any


KEY_LANES = 8  # keys per vector step of the scatter


@intrinsic
def _key_lanes(typingctx, b, i, mask, lo, inf_key):  # pragma: no cover - compiled
    """KEY_LANES keys from b[i], as one vector: bit j set for ``lo <= b[i+j] & mask``
    (NaN keys included) and bit KEY_LANES + j for a NaN key (``> inf_key``)."""
    sig = nbtypes.uint32(b, nbtypes.intp, b.dtype, b.dtype, b.dtype)

    def codegen(context, builder, signature, args):
        ba, idx, mv, lov, infv = args
        ity = context.get_value_type(signature.args[0].dtype)
        vty = ir.VectorType(ity, KEY_LANES)
        i32 = ir.IntType(32)
        data = context.make_array(signature.args[0])(context, builder, ba).data
        ptr = builder.bitcast(builder.gep(data, [idx]), vty.as_pointer())

        def splat(x):
            v = builder.insert_element(ir.Constant(vty, ir.Undefined), x, i32(0))
            lanes = ir.Constant(ir.VectorType(i32, KEY_LANES), [0] * KEY_LANES)
            return builder.shuffle_vector(v, v, lanes)

        keys = builder.and_(builder.load(ptr, align=1), splat(mv))
        ge = builder.icmp_unsigned(">=", keys, splat(lov))
        nan = builder.icmp_unsigned(">", keys, splat(infv))
        bits = ir.IntType(KEY_LANES)
        lo_bits = builder.zext(builder.bitcast(ge, bits), i32)
        hi_bits = builder.zext(builder.bitcast(nan, bits), i32)
        return builder.or_(lo_bits, builder.shl(hi_bits, i32(KEY_LANES)))

    return sig, codegen


# -- kernels ------------------------------------------------------------------------------
# Kernels loop over a slice of each chunk (``bc = b[lo:hi]``, index from 0): with a loop
# range(lo, hi) Numba cannot prove the index non-negative, keeps the wraparound check,
# and LLVM does not vectorize (measured 8x slower for the count).


@_kernels()
def _count(b, mask, lo, inf_key, bounds, counts, nans):  # pragma: no cover - compiled
    # counts[c]: keys >= lo in chunk c (NaN keys included), nans[c]: NaN keys in chunk c.
    for c in prange(bounds.shape[0] - 1):
        bc = b[bounds[c] : bounds[c + 1]]
        hit = 0
        bad = 0
        for i in range(bc.shape[0]):
            key = bc[i] & mask
            hit += key >= lo
            bad += key > inf_key
        counts[c] = hit
        nans[c] = bad


@_kernels()
def _scatter(
    b, mask, lo, inf_key, bounds, starts, caps, out_idx, out_bits, counts, nans
):  # pragma: no cover
    # Chunk c writes the index and bits of each key in [lo, inf_key] to out[starts[c]:]
    # while caps[c] slots last, and counts on when they run out: counts[c] = all its
    # hits, nans[c] = its NaN keys. Vector code tests KEY_LANES keys at a time into a bit
    # mask, eight masks make a 64-bit word, and only a word's set bits are visited (as in
    # the fused pass: a branch per block of keys, taken at random, cost 5x the memory
    # traffic).
    for c in prange(bounds.shape[0] - 1):
        s = bounds[c]
        bc = b[s : bounds[c + 1]]
        p = starts[c]
        end = p + caps[c]
        bad = 0
        m = bc.shape[0]
        m64 = m // 64 * 64
        for b0 in range(0, m64, 64):
            word = np.uint64(0)
            nan = np.uint64(0)
            for q in range(64 // KEY_LANES):
                t = q * KEY_LANES
                bits = _key_lanes(bc, b0 + t, mask, lo, inf_key)
                word |= np.uint64(bits & np.uint32(255)) << np.uint64(t)
                nan |= np.uint64(bits >> np.uint32(KEY_LANES)) << np.uint64(t)
            while nan:
                bad += 1
                nan &= nan - np.uint64(1)
            while word:
                j = _ctz(word)
                word &= word - np.uint64(1)
                if p < end:
                    out_idx[p] = s + b0 + j
                    out_bits[p] = bc[b0 + j]
                p += 1
        for i in range(m64, m):
            key = bc[i] & mask
            if key >= lo:
                if key > inf_key:
                    bad += 1
                else:
                    if p < end:
                        out_idx[p] = s + i
                        out_bits[p] = bc[i]
                    p += 1
        counts[c] = p - starts[c]
        nans[c] = bad


@_kernels()
def _histogram(
    b, mask, inf_key, shift, dmask, pshift, prefix, bounds, hist, nans
):  # pragma: no cover
    # hist[c, d]: keys of chunk c whose bits above pshift equal prefix and whose digit
    # (key >> shift) & dmask is d.
    for c in prange(bounds.shape[0] - 1):
        h = hist[c]
        bc = b[bounds[c] : bounds[c + 1]]
        bad = 0
        for i in range(bc.shape[0]):
            key = bc[i] & mask
            if (key >> pshift) == prefix:
                h[(key >> shift) & dmask] += 1
            bad += key > inf_key
        nans[c] = bad


@_kernels()
def _count_gt_eq(b, mask, kth, bounds, gt, eq):  # pragma: no cover
    for c in prange(bounds.shape[0] - 1):
        bc = b[bounds[c] : bounds[c + 1]]
        g = 0
        e = 0
        for i in range(bc.shape[0]):
            key = bc[i] & mask
            g += key > kth
            e += key == kth
        gt[c] = g
        eq[c] = e


@_kernels()
def _scatter_gt_eq(
    b, mask, kth, bounds, offsets, quota, src, use_src, out_idx, out_bits, taken
):  # pragma: no cover
    # Keys above kth, and the first quota[c] keys equal to kth in chunk c (lowest index
    # first); blocks of BLOCK keys with none at or above kth are skipped after a vectorized
    # count. Within a block every key is written at p and p advances when it is taken: no
    # branch on the key (on candidates, about half of them taken, that branch mispredicted
    # half the time). ``end`` keeps a chunk's writes inside its own slots. ``taken`` (None
    # or zeros) gets 1 where a key is taken.
    for c in prange(bounds.shape[0] - 1):
        s = bounds[c]
        bc = b[s : bounds[c + 1]]
        p = offsets[c]
        end = offsets[c + 1]
        q = quota[c]
        m = bc.shape[0]
        for base in range(0, m, BLOCK):
            blk = bc[base : min(base + BLOCK, m)]
            hit = 0
            for j in range(blk.shape[0]):
                hit += (blk[j] & mask) >= kth
            if hit == 0:
                continue
            for j in range(blk.shape[0]):
                key = blk[j] & mask
                tie = (key == kth) & (q > 0)
                q -= tie
                take = (key > kth) | tie
                i = s + base + j
                if p < end:
                    out_idx[p] = src[i] if use_src else i
                    out_bits[p] = blk[j]
                if taken is not None:
                    taken[i] = take
                p += take


# reassoc lets LLVM split the float64 sums into vector lanes instead of one serial
# chain of dependent adds; the result changes only by rounding. The sums are of
# v = x - shift and v² (see _common.moment_shift: E[x²] - mean² cancels); contract lets
# v² + q be one fused multiply-add, which pays for the subtraction (float64, one thread:
# 4.00 ms without, 3.81 with, 3.79 unshifted, on 16M entries here).
@_kernels(fastmath={"reassoc", "contract"})
def _sums(x, shift, bounds, s1, s2):  # pragma: no cover
    for c in prange(bounds.shape[0] - 1):
        xc = x[bounds[c] : bounds[c + 1]]
        a = 0.0
        q = 0.0
        for i in range(xc.shape[0]):
            v = np.float64(xc[i]) - shift
            a += v
            q += v * v
        s1[c] = a
        s2[c] = q


def _count_keys(b: np.ndarray, info: Any, lo: int, bounds: np.ndarray) -> np.ndarray:
    """Per-chunk counts of keys >= lo that are not NaN; raise on any NaN."""
    parts = bounds.shape[0] - 1
    counts = np.empty(parts, np.int64)
    nans = np.empty(parts, np.int64)
    _run(
        _count,
        b.shape[0],
        b,
        _u(info, info.mask),
        _u(info, lo),
        _u(info, info.inf_key),
        bounds,
        counts,
        nans,
    )
    if nans.any():
        raise ValueError(NAN_MESSAGE)
    return counts


def _gather_keys(
    b: np.ndarray, info: Any, lo: int, itype: Any, frac: float = 1.0, limit: int | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """Index and bits of every key in [lo, inf_key], ascending; raise on NaN.

    ``frac`` estimates the fraction of keys that qualify (1.0: room for all). Each chunk
    gets room for its share plus a safety margin, and the scatter runs once; a chunk that
    overflows still counts its hits, and the scatter reruns into exactly sized room (two
    passes, as with a count pass first) -- unless the hits exceed ``limit``: then None.
    """
    n = b.shape[0]
    bounds = _bounds(n, CHUNKS_PER_THREAD)
    parts = bounds.shape[0] - 1
    sizes = np.diff(bounds)
    mean = sizes * frac
    room = np.minimum(sizes, (1.2 * mean + 6.0 * np.sqrt(mean) + 64).astype(np.int64))
    mask, lo_, inf = _u(info, info.mask), _u(info, lo), _u(info, info.inf_key)
    while True:
        starts = np.zeros(parts, np.int64)
        np.cumsum(room[:-1], out=starts[1:])
        out_idx = np.empty(int(room.sum()), itype)
        out_bits = np.empty(out_idx.shape[0], info.utype)
        hits = np.empty(parts, np.int64)
        nans = np.empty(parts, np.int64)
        _run(_scatter, n, b, mask, lo_, inf, bounds, starts, room, out_idx, out_bits, hits, nans)
        if nans.any():
            raise ValueError(NAN_MESSAGE)
        if np.array_equal(hits, room):
            return out_idx, out_bits
        if np.all(hits <= room):
            cut = [slice(a, a + h) for a, h in zip(starts.tolist(), hits.tolist())]
            return (
                np.concatenate([out_idx[c] for c in cut]),
                np.concatenate([out_bits[c] for c in cut]),
            )
        if limit is not None and hits.sum() > limit:
            return None
        room = hits


def _sample(b: np.ndarray, info: Any) -> np.ndarray:
    """SAMPLE_SIZE keys at a fixed stride (all of b when it is shorter)."""
    n = b.shape[0]
    stride = max(1, n // SAMPLE_SIZE)
    return b[stride // 2 :: stride][:SAMPLE_SIZE] & _u(info, info.mask)


def _kth_key(b: np.ndarray, info: Any, k: int) -> int:
    """The k-th largest key of b (1 <= k <= len(b)) by radix select; raise on NaN."""
    m = b.shape[0]
    bounds = _bounds(m, 1)
    parts = bounds.shape[0] - 1
    digit = 16 if m > 1 << 20 else 11 if m > 1 << 12 else 8
    nans = np.empty(parts, np.int64)
    prefix, done, rank = 0, 0, k
    while done < info.bits:
        d = min(digit, info.bits - done)
        shift = info.bits - done - d
        hist = np.zeros((parts, 1 << d), np.int64)
        _run(
            _histogram, m, b, _u(info, info.mask), _u(info, info.inf_key), _u(info, shift),
            _u(info, (1 << d) - 1), _u(info, info.bits - done), _u(info, prefix), bounds,
            hist, nans,
        )  # fmt: skip
        if done == 0 and nans.any():
            raise ValueError(NAN_MESSAGE)
        h = hist.sum(axis=0)
        from_top = np.cumsum(h[::-1])
        j = int(np.searchsorted(from_top, rank))  # first digit (from the top) reaching rank
        v = (1 << d) - 1 - j
        rank -= int(from_top[j] - h[v])
        prefix = (prefix << d) | v
        done += d
    return prefix


def _select_rank(
    b: np.ndarray,
    info: Any,
    kth: int,
    k: int,
    src: np.ndarray | None,
    itype: Any,
    taken: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The k entries of b: keys above kth, then keys equal to kth by ascending position
    (marked in ``taken``, zeros of b's length, when given)."""
    bounds = _bounds(b.shape[0], CHUNKS_PER_THREAD)
    parts = bounds.shape[0] - 1
    gt = np.empty(parts, np.int64)
    eq = np.empty(parts, np.int64)
    mask, kt = _u(info, info.mask), _u(info, kth)
    _run(_count_gt_eq, b.shape[0], b, mask, kt, bounds, gt, eq)
    need = k - int(gt.sum())
    eq_before = np.cumsum(eq) - eq
    quota = np.clip(need - eq_before, 0, eq)
    offsets = np.zeros(parts + 1, np.int64)
    np.cumsum(gt + quota, out=offsets[1:])
    assert offsets[-1] == k
    out_idx = np.empty(k, itype)
    out_bits = np.empty(k, info.utype)
    use_src = src is not None
    if src is None:
        src = np.empty(0, itype)
    _run(
        _scatter_gt_eq, b.shape[0], b, mask, kt, bounds, offsets, quota, src, use_src,
        out_idx, out_bits, taken,
    )  # fmt: skip
    return out_idx, out_bits


def _candidates(
    b: np.ndarray, info: Any, k: int, itype: Any
) -> tuple[np.ndarray, np.ndarray] | None:
    """Entries with keys at or above a sampled cut (ascending index), if that cut keeps
    between k and n/2 of them; None when the sample is no help."""
    n = b.shape[0]
    if n < PREFILTER_MIN_N or k > n // 8:  # a prefilter keeping over 1/8 saves too little
        return None
    sample = _sample(b, info)
    s = sample.shape[0]
    expect = k * s / n
    r = int(expect + 4.0 * math.sqrt(expect) + 8.0)  # ~4 sigma above the expected rank
    if r >= s:
        return None
    lo = int(np.partition(sample, s - r)[s - r])
    frac = float(np.count_nonzero(sample >= lo)) / s
    if frac > 0.5:
        return None
    cand = _gather_keys(b, info, lo, itype, frac, limit=n // 2)
    if cand is None or cand[0].shape[0] < k:
        return None
    return cand


def _check_nan(b: np.ndarray, info: Any) -> None:
    _count_keys(b, info, info.inf_key, _bounds(b.shape[0], CHUNKS_PER_THREAD))


# -- backend functions (the names every backend provides) ---------------------------------


def topk(x: np.ndarray, k: int, itype: Any = None) -> tuple[np.ndarray, np.ndarray]:
    n = x.shape[0]
    itype = index_dtype(n) if itype is None else itype
    b, info = _keys(x)
    if k == 0 or k == n:
        _check_nan(b, info)
        return np.arange(k, dtype=itype), x[:k].copy()
    cand = _candidates(b, info, k, itype)
    if cand is not None:
        cidx, cbits = cand
        kth = _kth_key(cbits, info, k)
        idx, bits = _select_rank(cbits, info, kth, k, cidx, itype)
    else:
        kth = _kth_key(b, info, k)
        idx, bits = _select_rank(b, info, kth, k, None, itype)
    return idx, bits.view(x.dtype)


def kth_largest_abs(x: np.ndarray, k: int) -> float:
    b, info = _keys(x)
    cand = _candidates(b, info, k, index_dtype(x.shape[0]))
    if cand is not None:
        return key_value(_kth_key(cand[1], info, k), x.dtype)
    return key_value(_kth_key(b, info, k), x.dtype)


def threshold(x: np.ndarray, t: float, itype: Any = None) -> tuple[np.ndarray, np.ndarray]:
    n = x.shape[0]
    itype = index_dtype(n) if itype is None else itype
    b, info = _keys(x)
    lo = threshold_key(t, x.dtype)
    frac = 1.0  # small x: room for all of it
    if n >= PREFILTER_MIN_N:  # size the output from a sample: one pass over x, not two
        sample = _sample(b, info)
        frac = float(np.count_nonzero(sample >= lo)) / sample.shape[0]
    idx, bits = _gather_keys(b, info, lo, itype, frac)
    return idx, bits.view(x.dtype)


def count_ge(x: np.ndarray, t: float) -> int:
    b, info = _keys(x)
    return int(
        _count_keys(
            b, info, threshold_key(t, x.dtype), _bounds(x.shape[0], CHUNKS_PER_THREAD)
        ).sum()
    )


def moments(x: np.ndarray) -> tuple[float, float]:
    n = x.shape[0]
    if x.dtype == np.float16:  # Numba has no float16 arithmetic
        x = x.astype(np.float32)
    bounds = _bounds(n, 1)
    sums = np.empty((2, bounds.shape[0] - 1))
    shift = moment_shift(x)
    _run(_sums, n, x, shift, bounds, *sums)
    with np.errstate(over="ignore", invalid="ignore"):  # (the chunks' sums: rescaled below)
        a, q = float(sums[0].sum()), float(sums[1].sum())
    if x.dtype == np.float64:  # (float32's squares always fit)
        mean, std = moments_of(x, shift, (a, q))  # (summed again, scaled, where they did not)
    else:
        mean, std = moments_from_sums(n, a, q, shift)
    if mean != mean or std != std:  # NaN in x, or +inf with -inf (a pass only then)
        _check_nan(*_keys(x))
    return mean, std
