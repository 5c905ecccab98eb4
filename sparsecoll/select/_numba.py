"""CPU selection kernels in Numba: chunked count / prefix-scan / scatter, and radix select.

Every kernel reads the unsigned-integer view of x and masks the sign bit (see ``_common``), so
the same code serves float16, float32 and float64 and compares |x| exactly.

* threshold: a strided sample of 16 Ki keys estimates how many keys qualify; each chunk of x
  gets that share of the output (plus a margin) and one parallel pass scatters indices and
  values into it, counting NaNs on the way; the chunks' pieces are then concatenated. A
  chunk that overflows its room still counts its hits, and a second pass scatters again
  into exactly sized room (the count / prefix-scan / scatter scheme). Keys are tested 8 at a
  time into bit masks (LLVM vector code), and the copy loop visits only a 64-key word's set
  bits.
* top-k: the sample also gives a key that probably has a little more than k keys at or
  above it; one such scatter collects those candidates in index order and checks there are
  at least k (and at most n/2). The exact k-th largest key is then found by radix select
  (histograms of 8/11/16-bit digits, most significant first) over the candidates only, and
  a count/scatter over them applies the tie rule (keys above the k-th, then the
  lowest-indexed keys equal to it). When the sample misleads (too few or too many
  candidates) the same radix select runs over the whole array: slower, same result.
* Threads. Every kernel is compiled twice: a serial version and a parallel one. Arrays under
  2**22 keys, and every array when only one thread is available, run the serial version,
  which never touches Numba's thread pool: waking the pool costs more than the job there,
  and an idle OpenMP pool spins, stealing the cores that other MPI ranks on the node need
  (measured: a 64K-parameter training step 4x slower with 4 ranks on 2 cores). The thread
  count (:func:`get_num_threads`) is the cores this process may run on divided by the MPI
  ranks on its node (from the launcher's environment: MPICH/Hydra, Open MPI, MVAPICH,
  Slurm, PALS), at least 1; ``SPARSECOLL_NUM_THREADS``, ``NUMBA_NUM_THREADS`` or
  :func:`set_num_threads` override it.

The training step's fused pass (``_numba_train``) is built on these kernels' helpers.

Inputs are validated by ``sparsecoll.select``: x is a contiguous 1-D float16/32/64 array,
1 <= k <= n where noted, t a float that is not NaN.
"""

from __future__ import annotations

import math
import os
import types
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba import types as nbtypes
from numba.extending import intrinsic

try:  # LLVM's cttz: the position of the lowest set bit (the bit width for 0)
    from numba.cpython.unsafe.numbers import trailing_zeros as _ctz
except ImportError:  # pragma: no cover - older or newer Numba without it

    @njit(inline="always")
    def _ctz(x):
        if x == 0:
            return 64  # as cttz with zero defined
        j = 0
        while not (x >> j) & 1:
            j += 1
        return j


from .._array import index_dtype
from .._jit import cached_njit
from .._options import env_integer
from ._common import (
    NAN_MESSAGE,
    key_info,
    key_value,
    moment_shift,
    moments_from_sums,
    moments_of,
    threshold_key,
)

__all__ = [
    "count_ge",
    "get_num_threads",
    "kth_largest_abs",
    "moments",
    "set_num_threads",
    "threshold",
    "topk",
    "warmup",
]

# Tunables (tests lower them to reach every code path on small arrays).
MIN_CHUNK = 1 << 16  # elements per parallel chunk, at least
CHUNKS_PER_THREAD = 4  # count/scatter chunks per thread (evens out a shared machine)
PREFILTER_MIN_N = 1 << 16  # below this, radix select runs on x directly
SAMPLE_SIZE = 1 << 14  # keys sampled to place the candidate cut
PARALLEL_MIN = 1 << 22  # smaller arrays run on one thread (a parallel launch costs more)
BLOCK = 32  # keys per block tested before the scatter loops copy any


# -- threads ------------------------------------------------------------------------------
# Environment variables through which launchers tell a process how many ranks share its node.
LOCAL_SIZE_VARS = (
    "MPI_LOCALNRANKS",  # MPICH / Hydra
    "OMPI_COMM_WORLD_LOCAL_SIZE",  # Open MPI
    "MV2_COMM_WORLD_LOCAL_SIZE",  # MVAPICH
    "PALS_LOCAL_SIZE",  # HPE Cray PALS
    "SLURM_NTASKS_PER_NODE",  # Slurm (when set)
)
_threads: int | None = None  # chosen on first use, or by set_num_threads


def _local_ranks() -> int:
    for var in LOCAL_SIZE_VARS:
        text = os.environ.get(var, "").split("(")[0].split(",")[0]  # Slurm: "4(x2),3"
        if text.strip().isdigit() and int(text) > 0:
            return int(text)
    return 1


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def get_num_threads() -> int:
    """Threads the selection kernels use: cores available / MPI ranks on this node (>= 1),
    unless set by ``SPARSECOLL_NUM_THREADS``, ``NUMBA_NUM_THREADS`` or
    :func:`set_num_threads`; never more than Numba's pool."""
    global _threads
    if _threads is None:
        pool = numba.config.NUMBA_NUM_THREADS
        want = env_integer("SPARSECOLL_NUM_THREADS", 1)  # (x or -1: an error, not dropped)
        if want is None:
            want = pool if "NUMBA_NUM_THREADS" in os.environ else _cores() // _local_ranks()
        _threads = min(pool, max(1, want))
    return _threads


def set_num_threads(n: int) -> None:
    """Use n threads (1 <= n <= Numba's ``NUMBA_NUM_THREADS``) in the selection kernels."""
    global _threads
    pool = numba.config.NUMBA_NUM_THREADS
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
        # (a ValueError before, and np.int64(2) refused as "must be an integer")
        raise TypeError(f"threads must be an integer in [1, {pool}], got {type(n).__name__}")
    if not 1 <= n <= pool:
        raise ValueError(f"threads must be an integer in [1, {pool}], got {n!r}")
    _threads = int(n)


class _Kernel:
    """A kernel compiled twice: ``serial`` (prange runs as range) and ``parallel``."""

    __slots__ = ("parallel", "serial")

    def __init__(self, fn: Any, **flags: Any) -> None:
        self.parallel = cached_njit(parallel=True, nogil=True, **flags)(fn)
        # A separate function object (its own name, so its own cache file: Numba's cache
        # is keyed by name and signature, not by the parallel flag).
        twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial")
        twin.__qualname__ = fn.__qualname__ + "_serial"
        twin.__module__ = fn.__module__
        self.serial = cached_njit(nogil=True, **flags)(twin)


def _kernels(**flags: Any) -> Any:
    return lambda fn: _Kernel(fn, **flags)


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


# -- drivers ------------------------------------------------------------------------------


def _parallel(n: int) -> bool:
    return n >= PARALLEL_MIN and get_num_threads() > 1


def _bounds(n: int, per_thread: int) -> np.ndarray:
    threads = get_num_threads() if _parallel(n) else 1
    parts = max(1, min(-(-n // MIN_CHUNK), per_thread * threads))
    return (np.arange(parts + 1, dtype=np.int64) * n) // parts


def _run(kernel: _Kernel, m: int, *args: Any) -> None:
    """Call a kernel over m keys: the serial version when m is small or one thread is all
    there is; else the parallel one on get_num_threads() threads, handed chunks one at a time
    (a thread that the OS parks on a shared machine then holds up less)."""
    if not _parallel(m):
        kernel.serial(*args)
        return
    threads = get_num_threads()
    if numba.get_num_threads() != threads:  # Numba's setting is per calling thread
        numba.set_num_threads(threads)
    with numba.parallel_chunksize(1):
        kernel.parallel(*args)


def _keys(x: np.ndarray) -> tuple[np.ndarray, Any]:
    info = key_info(x.dtype)
    return x.view(info.utype), info


def _u(info: Any, v: int) -> Any:
    return info.utype.type(v)


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


def warmup(parallel: bool = False) -> None:
    """Compile (or load from the cache) every serial kernel for every dtype, and with
    ``parallel`` the parallel ones too (that also starts Numba's thread pool)."""
    global PARALLEL_MIN
    saved = PARALLEL_MIN
    for big in (False, True) if parallel and get_num_threads() > 1 else (False,):
        PARALLEL_MIN = 1 if big else saved
        try:
            for dt in (np.float16, np.float32, np.float64):
                x = np.linspace(-1.0, 1.0, 64).astype(dt)
                topk(x, 5)  # int32 indices; int64 ones (n > 2**31) compile on first use
                threshold(x, 0.5)
                kth_largest_abs(x, 3)
                count_ge(x, 0.5)
                moments(x)
        finally:
            PARALLEL_MIN = saved


def accumulate(*args: Any, **kwargs: Any) -> Any:
    """The fused error-feedback pass, :func:`._numba_train.accumulate` (imported here on
    first use: that module builds on this one)."""
    from ._numba_train import accumulate as fused

    return fused(*args, **kwargs)


# -- bucketing and counts at edges (the oktopk threshold window) -------------------------


@cached_njit(nogil=True)
def _bucketize(x, edges, out):  # pragma: no cover - compiled
    # out[i] = how many of the ascending edges are <= x[i]: a branch-free binary search
    # over edges padded with +inf to 2**levels - 1 (a branch per level mispredicted half
    # the time: ~3x slower)
    top = edges.shape[0] + 1  # the padded length is top - 1 = 2**levels - 1
    for i in range(x.shape[0]):
        v = x[i]
        pos = 0
        step = top >> 1
        while step:
            pos += step * (edges[pos + step - 1] <= v)
            step >>= 1
        out[i] = pos


def bucketize(x: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """``np.searchsorted(edges, x, side="right")`` for ascending ``edges`` of x's dtype
    (numpy's takes ~50 ns an element on unsorted x; this a few)."""
    out = np.empty(x.shape[0], np.int64)
    if x.dtype == np.float16:  # Numba has no float16 comparisons
        x, edges = x.astype(np.float32), edges.astype(np.float32)
    e = edges.shape[0]
    size = 1
    while size - 1 < e:
        size *= 2
    padded = np.full(size - 1, np.inf, dtype=x.dtype)
    padded[:e] = edges
    _bucketize(np.ascontiguousarray(x), padded, out)
    return np.minimum(out, e, out=out)  # NaN and +inf x: counted against the real edges only


@cached_njit(nogil=True)
def _count_at_edges(x, edges, out):  # pragma: no cover - compiled
    # out[j] = #(|x| >= edges[j]): one vectorized pass per edge over x (candidates: small)
    for j in range(edges.shape[0]):
        e = edges[j]
        c = 0
        for i in range(x.shape[0]):
            c += abs(x[i]) >= e
        out[j] = c


@cached_njit(nogil=True)
def _edges_below(x, lo, scale, top, edge_in, first, counts, hist):  # pragma: no cover
    # hist[j]: elements of |x| with exactly j edges <= them (NaN: none). A linear bin of
    # [edges[0], edges[-1]] places each element (below: bin 0, above: bin top); every
    # element of bin b has first[b] edges below it, plus one if it is >= edge_in[b] (the
    # one edge that may lie in or next to the bin; inf if none). No branch on the data:
    # a walk along the edges where a bin holds one mispredicted at ~5 ns an element.
    for i in range(x.shape[0]):
        v = abs(x[i])
        f = (np.float64(v) - lo) * scale
        f = f if f > 0.0 else 0.0  # (NaN: bin 0, where no edge is <= it)
        f = f if f < top else np.float64(top)
        b = int(f)
        counts[2 * b + (v >= edge_in[b])] += 1
    for b in range(top + 1):
        hist[first[b]] += counts[2 * b]
        hist[first[b] + 1] += counts[2 * b + 1]


EDGE_BINS = 1024  # linear bins that place an element among the edges (count_at_edges)
LIFT = 2.0**600  # subnormal float64 edges times this: bins of a finite width


@cached_njit(nogil=True)
def _binned_at_edges(x, edges, top, out):  # pragma: no cover - compiled
    # count_at_edges through `top` linear bins of [edges[0], the last finite edge]: False
    # (out untouched) when some bin may hold two edges. An infinite edge (edges past the
    # dtype's largest finite value round to it) is the top bin's: the bins then reach two
    # bins past the last finite edge, so every element of the top bin is above that edge,
    # and only infinities are >= the one in it.
    e = edges.shape[0]
    fin = e - 1 if edges[e - 1] == np.inf else e  # the finite edges (distinct: one inf)
    lo, hi = np.float64(edges[0]), np.float64(edges[fin - 1])
    span = (hi - lo) * (1.0 + 2.0 / top) if fin < e else hi - lo
    scale = top / span
    slack = 1e-3 / scale  # far beyond any rounding of the bin arithmetic
    # bin b is [lo + b / scale, lo + (b + 1) / scale) (the top bin: everything above).
    # first[b]: edges surely below every element of bin b (bin 0 also holds everything
    # below lo), and edge_in[b] the one edge that may lie in or next to it (inf if none)
    first = np.empty(top + 1, np.int64)
    edge_in = np.full(top + 1, np.inf, dtype=x.dtype)
    f = 0
    g = 0
    for b in range(top + 1):
        start = lo + b / scale  # (inf past float64's range: above every finite edge)
        while f < fin and np.float64(edges[f]) < start - slack:
            f += 1
        first[b] = 0 if b == 0 else f
        end = lo + (b + 1) / scale + slack if b < top else np.inf
        while g < fin and np.float64(edges[g]) <= end:
            g += 1
        if g - first[b] > 1:
            return False
        if g > first[b]:
            edge_in[b] = edges[first[b]]
    if fin < e:
        if first[top] != fin:  # (the top bin starts two bins above the last finite edge)
            return False
        edge_in[top] = edges[fin]
    counts = np.zeros(2 * (top + 1), np.int64)
    hist = np.zeros(e + 2, np.int64)
    _edges_below(x, lo, scale, top, edge_in, first, counts, hist)
    c = 0
    for j in range(e - 1, -1, -1):  # out[j] = hist[j + 1] + ... + hist[e]
        c += hist[j + 1]
        out[j] = c
    return True


def count_at_edges(x: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """``[#(|x| >= e) for e in edges]`` (int64) for ascending edges, exactly as compared in
    x's dtype: one pass over x (a pass per edge below EDGE_BINS elements, or when edges
    lie too close together for the bins to tell them apart). Edges past the largest finite
    value of x's dtype round to inf there and count the infinities, in the same pass."""
    if x.dtype == np.float16:  # exact in float32: every float16 is a float32
        x, edges = x.astype(np.float32), edges.astype(np.float32)
    x = np.ascontiguousarray(x)
    with np.errstate(over="ignore"):  # (edges past x's range: inf, as compared in x's dtype)
        edges = np.ascontiguousarray(edges, dtype=x.dtype)
    # equal edges (subnormal ones round together) would share a bin: count each value once
    tied = bool(np.any(edges[1:] == edges[:-1]))
    if tied:
        edges, which = np.unique(edges, return_inverse=True)
    out = np.empty(edges.shape[0], np.int64)
    lo, hi = float(edges[0]), float(edges[-1])
    if hi == math.inf and edges.shape[0] > 1:  # edges past the dtype's range round to inf:
        hi = float(edges[-2])  # the finite ones are binned, inf takes the top bin
    binned = x.shape[0] >= EDGE_BINS and math.isfinite(lo) and math.isfinite(hi) and hi > lo
    if binned and not math.isfinite(EDGE_BINS / (hi - lo)):
        # float64 subnormal edges: bins finer than float64 can scale to. Lifted by a power
        # of two (exact; a value lifted past the largest float is inf, above every edge as
        # before): one more pass, against a pass per edge
        with np.errstate(over="ignore"):
            x, edges = x * LIFT, edges * LIFT
    if not (binned and _binned_at_edges(x, edges, EDGE_BINS, out)):
        _count_at_edges(x, edges, out)
    return out[which] if tied else out
