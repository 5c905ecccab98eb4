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

from .._array import IEEE_ARITHMETIC, cupy_or_none, index_dtype, nonzero_count
from ._common import magnitude_ge, threshold_key

__all__ = ["count_ge", "kth_largest_abs", "moments", "threshold", "topk"]

_UINT = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}
_INF_KEY = {2: 0x7C00, 4: 0x7F80_0000, 8: 0x7FF0_0000_0000_0000}
_DIGIT = 12  # bits of the key fixed per histogram pass
_BINS = 1 << _DIGIT
_CANDIDATES = 1 << 21  # gather a bin's keys and sort them once it holds at most this many
_BLOCK = 256  # threads of a compaction block
_ITEMS = 16  # entries per thread: a compaction tile is 4096 entries
_TILE = _BLOCK * _ITEMS
_HIST_BLOCK = 512
_C_KEY = {2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}
_C_INDEX = {4: "int", 8: "long long"}

# The kernels, for one key type U (the unsigned integer of x's width) and one index type I
# of the output. pick(): the selection {key > hi} plus {key == hi, index <= icut}.
_SOURCE = r"""
typedef KEY_T U;
typedef INDEX_T I;
#define BINS BINS_V
#define BLOCK BLOCK_V
#define ITEMS ITEMS_V
#define TILE (BLOCK * ITEMS)

__device__ __forceinline__ bool pick(U key, U hi, long long i, long long icut) {
    return key > hi || (key == hi && i <= icut);
}

__device__ __forceinline__ void count_key(unsigned int* sh, U key, U infkey, U pmask,
                                          U prefix, int shift) {
    if ((U)(key & pmask) == prefix) atomicAdd(&sh[(unsigned int)(key >> shift) & (BINS - 1)], 1u);
    if (key > infkey) atomicAdd(&sh[BINS], 1u);
}

extern "C" {

// hist[d] += how many keys matching `prefix` under `pmask` have digit d at `shift`;
// hist[BINS] += how many keys are NaNs'. Counted per block in shared memory first.
__global__ void sc_hist(const U* __restrict__ bits, long long n, U absmask, U infkey,
                        U pmask, U prefix, int shift, unsigned long long* __restrict__ hist) {
    __shared__ unsigned int sh[BINS + 1];
    for (int j = threadIdx.x; j <= BINS; j += blockDim.x) sh[j] = 0;
    __syncthreads();
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {  // four loads in flight
        U k0 = bits[i] & absmask, k1 = bits[i + stride] & absmask;
        U k2 = bits[i + 2 * stride] & absmask, k3 = bits[i + 3 * stride] & absmask;
        count_key(sh, k0, infkey, pmask, prefix, shift);
        count_key(sh, k1, infkey, pmask, prefix, shift);
        count_key(sh, k2, infkey, pmask, prefix, shift);
        count_key(sh, k3, infkey, pmask, prefix, shift);
    }
    for (; i < n; i += stride) count_key(sh, bits[i] & absmask, infkey, pmask, prefix, shift);
    __syncthreads();
    for (int j = threadIdx.x; j <= BINS; j += blockDim.x) {
        unsigned int c = sh[j];
        if (c) atomicAdd(&hist[j], (unsigned long long)c);
    }
}

// Every key matching `prefix` under `pmask`, with its index, in no particular order.
__global__ void sc_gather(const U* __restrict__ bits, long long n, U absmask, U pmask,
                          U prefix, U* __restrict__ ckey, long long* __restrict__ cidx,
                          unsigned long long* __restrict__ count) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const unsigned int lane = threadIdx.x & 31;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        U key = bits[i] & absmask;
        bool hit = (U)(key & pmask) == prefix;
        unsigned int ballot = __ballot_sync(__activemask(), hit);
        if (hit) {  // one atomic per warp
            int leader = __ffs(ballot) - 1;
            unsigned long long base = 0;
            if ((int)lane == leader) base = atomicAdd(count, (unsigned long long)__popc(ballot));
            base = __shfl_sync(ballot, base, leader);
            unsigned long long pos = base + __popc(ballot & ((1u << lane) - 1u));
            ckey[pos] = key;
            cidx[pos] = i;
        }
    }
}

__device__ __forceinline__ unsigned int block_sum(unsigned int c, unsigned int* ws) {
    for (int o = 16; o; o >>= 1) c += __shfl_down_sync(0xffffffffu, c, o);
    if ((threadIdx.x & 31) == 0) ws[threadIdx.x >> 5] = c;
    __syncthreads();
    unsigned int t = 0;
    for (int w = 0; w < BLOCK / 32; ++w) t += ws[w];
    return t;
}

// counts[b] = the picks in tile b; flag[0] = 1 when some key is a NaN's.
__global__ void sc_count(const U* __restrict__ bits, long long n, U absmask, U infkey,
                         const long long* __restrict__ cut, unsigned int* __restrict__ counts,
                         unsigned long long* __restrict__ flag) {
    __shared__ unsigned int ws[BLOCK / 32];
    const U hi = (U)cut[0];
    const long long icut = cut[1];
    const long long start = (long long)blockIdx.x * TILE + threadIdx.x;
    unsigned int c = 0;
    bool nan = false;
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
        long long i = start + (long long)it * BLOCK;
        if (i < n) {
            U key = bits[i] & absmask;
            c += pick(key, hi, i, icut);
            nan |= key > infkey;
        }
    }
    if (nan) flag[0] = 1ull;  // (a benign race: every writer stores 1)
    unsigned int t = block_sum(c, ws);
    if (threadIdx.x == 0) counts[blockIdx.x] = t;
}

// Exclusive prefix sum of c over the block (thread order), and the block's total.
__device__ __forceinline__ unsigned int block_scan(unsigned int c, unsigned int* ws,
                                                   unsigned int* total) {
    const unsigned int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned int x = c;
    for (int o = 1; o < 32; o <<= 1) {
        unsigned int y = __shfl_up_sync(0xffffffffu, x, o);
        if ((int)lane >= o) x += y;
    }
    if (lane == 31) ws[warp] = x;
    __syncthreads();
    unsigned int before = 0, t = 0;
    for (int w = 0; w < BLOCK / 32; ++w) {
        unsigned int v = ws[w];
        before += w < (int)warp ? v : 0u;
        t += v;
    }
    *total = t;
    return before + x - c;
}

// The picks of tile b, in index order, at ends[b] - counts[b] onwards: indices and raw bits.
// Each thread takes ITEMS consecutive entries, so one block scan orders the whole tile.
__global__ void sc_write(const U* __restrict__ bits, long long n, U absmask,
                         const long long* __restrict__ cut,
                         const unsigned long long* __restrict__ ends,
                         const unsigned int* __restrict__ counts, I* __restrict__ oidx,
                         U* __restrict__ oval) {
    __shared__ unsigned int ws[BLOCK / 32];
    const U hi = (U)cut[0];
    const long long icut = cut[1];
    const long long base = (long long)blockIdx.x * TILE + (long long)threadIdx.x * ITEMS;
    U raw[ITEMS];
    unsigned int c = 0;
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) raw[it] = base + it < n ? bits[base + it] : (U)0;
#pragma unroll
    for (int it = 0; it < ITEMS; ++it)
        c += base + it < n && pick(raw[it] & absmask, hi, base + it, icut);
    unsigned int total;
    unsigned long long p = ends[blockIdx.x] - counts[blockIdx.x] + block_scan(c, ws, &total);
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
        if (base + it < n && pick(raw[it] & absmask, hi, base + it, icut)) {
            oidx[p] = (I)(base + it);
            oval[p] = raw[it];
            ++p;
        }
    }
}

// Keys of 31 bits or fewer, n <= 2^32: tile b's keys above the prefix's bin are counted
// into counts[b], and the bin's keys are gathered packed as (inverted key) << 32 | index,
// so an ascending sort orders them by key descending, then index ascending.
__global__ void sc_gather_packed(const U* __restrict__ bits, long long n, U absmask, U pmask,
                                 U prefix, unsigned long long* __restrict__ cand,
                                 unsigned long long* __restrict__ ncand,
                                 unsigned int* __restrict__ counts) {
    __shared__ unsigned int ws[BLOCK / 32];
    const unsigned int lane = threadIdx.x & 31;
    const long long start = (long long)blockIdx.x * TILE + threadIdx.x;
    U raw[ITEMS];
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
        long long i = start + (long long)it * BLOCK;
        raw[it] = i < n ? bits[i] : (U)0;
    }
    unsigned int above = 0;
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
        long long i = start + (long long)it * BLOCK;
        U key = raw[it] & absmask;
        U p = key & pmask;
        bool in = i < n;
        above += in && p > prefix;
        bool hit = in && p == prefix;
        unsigned int ballot = __ballot_sync(0xffffffffu, hit);
        if (ballot) {  // one atomic per warp
            int leader = __ffs(ballot) - 1;
            unsigned long long base = 0;
            if ((int)lane == leader) base = atomicAdd(ncand, (unsigned long long)__popc(ballot));
            base = __shfl_sync(0xffffffffu, base, leader);
            if (hit)
                cand[base + __popc(ballot & ((1u << lane) - 1u))] =
                    ((unsigned long long)(U)(absmask & (U)~key) << 32) | (unsigned long long)i;
        }
    }
    unsigned int t = block_sum(above, ws);
    if (threadIdx.x == 0) counts[blockIdx.x] = t;
}

// The first `take` of the sorted packed candidates are kept: count each in its tile, and
// write the cut (the last kept key and its index) for the write pass.
__global__ void sc_take_packed(const unsigned long long* __restrict__ sorted, long long take,
                               U absmask, unsigned int* __restrict__ counts,
                               long long* __restrict__ cut) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < take) atomicAdd(&counts[(sorted[j] & 0xffffffffull) / TILE], 1u);
    if (j == take - 1) {
        cut[0] = (long long)(U)(absmask & (U)~(U)(sorted[j] >> 32));
        cut[1] = (long long)(sorted[j] & 0xffffffffull);
    }
}

// The same two passes over a bool mask (the indices of its true entries).
__global__ void sc_mask_count(const unsigned char* __restrict__ mask, long long n,
                              unsigned int* __restrict__ counts) {
    __shared__ unsigned int ws[BLOCK / 32];
    const long long start = (long long)blockIdx.x * TILE + threadIdx.x;
    unsigned int c = 0;
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
        long long i = start + (long long)it * BLOCK;
        if (i < n) c += mask[i] != 0;
    }
    unsigned int t = block_sum(c, ws);
    if (threadIdx.x == 0) counts[blockIdx.x] = t;
}

__global__ void sc_mask_write(const unsigned char* __restrict__ mask, long long n,
                              const unsigned long long* __restrict__ ends,
                              const unsigned int* __restrict__ counts, I* __restrict__ oidx) {
    __shared__ unsigned int ws[BLOCK / 32];
    const long long base = (long long)blockIdx.x * TILE + (long long)threadIdx.x * ITEMS;
    unsigned char m[ITEMS];
    unsigned int c = 0;
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
        m[it] = base + it < n ? mask[base + it] : (unsigned char)0;
        c += m[it] != 0;
    }
    unsigned int total;
    unsigned long long p = ends[blockIdx.x] - counts[blockIdx.x] + block_scan(c, ws, &total);
#pragma unroll
    for (int it = 0; it < ITEMS; ++it)
        if (m[it]) oidx[p++] = (I)(base + it);
}

}  // extern "C"
"""


def kernel_source(key_bytes: int, index_bytes: int) -> str:
    """The CUDA source of the selection kernels for keys of ``key_bytes`` bytes and output
    indices of ``index_bytes`` bytes (the NVRTC compile test reads it too)."""
    return (
        _SOURCE.replace("KEY_T", _C_KEY[key_bytes])
        .replace("INDEX_T", _C_INDEX[index_bytes])
        .replace("BINS_V", str(_BINS))
        .replace("BLOCK_V", str(_BLOCK))
        .replace("ITEMS_V", str(_ITEMS))
    )


KERNEL_OPTIONS = ("--std=c++14",)


@functools.cache
def _module(cp: Any, key_bytes: int, index_bytes: int) -> Any:
    return cp.RawModule(code=kernel_source(key_bytes, index_bytes), options=KERNEL_OPTIONS)


def _kernel(cp: Any, name: str, key_bytes: int, index_bytes: int = 8) -> Any:
    return _module(cp, key_bytes, index_bytes).get_function(name)


@functools.cache
def _grid_cap(cp: Any) -> int:
    """Blocks of a grid-stride pass: enough to fill every multiprocessor."""
    try:
        sms = int(cp.cuda.Device().attributes["MultiProcessorCount"])
    except Exception:  # (the fake CuPy in CI has no device attributes)
        sms = 132
    return 4 * sms


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


def _histogram(bits: Any, absmask: Any, infkey: Any, pmask: int, prefix: int, shift: int):
    """The 4096-bin histogram of the digit at ``shift`` over the keys that match ``prefix``
    under ``pmask``, with the NaN count last, on the host (numpy uint64)."""
    cp = cupy_or_none()
    ut = bits.dtype.type
    n = int(bits.shape[0])
    hist = cp.zeros(_BINS + 1, dtype=np.uint64)
    args = (bits, np.int64(n), absmask, infkey, ut(pmask), ut(prefix), np.int32(shift), hist)
    _kernel(cp, "sc_hist", bits.dtype.itemsize)((_stride_grid(n),), (_HIST_BLOCK,), args)
    return hist.get()


def _stride_grid(n: int) -> int:
    """Blocks of ``_HIST_BLOCK`` threads for a grid-stride pass over n entries."""
    return max(1, min(-(-n // _HIST_BLOCK), _grid_cap(cupy_or_none())))


def _bin_of(hist: Any, remaining: int) -> tuple[int, int, int]:
    """``(digit, remaining, in_bin)``: the bin of the histogram where the running count
    from the top reaches ``remaining``, how many of those lie in it, and its count."""
    from_top = np.cumsum(hist[_BINS - 1 :: -1])  # [j]: keys with digit >= BINS-1-j
    j = int(np.searchsorted(from_top, remaining))
    if j:
        remaining -= int(from_top[j - 1])
    digit = _BINS - 1 - j
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
        shift = max(shift - _DIGIT, 0)
        hist = _histogram(bits, absmask, infkey, pmask, prefix, shift)
        if pmask == 0 and hist[_BINS]:
            raise _nan_error()
        digit, remaining, in_bin = _bin_of(hist, remaining)
        prefix |= digit << shift
        pmask = (pmask | ((_BINS - 1) << shift)) & full
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
    _kernel(cp, "sc_gather", bits.dtype.itemsize)((_stride_grid(n),), (_HIST_BLOCK,), args)
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
    tile = bits[b * _TILE : (b + 1) * _TILE].get() & absmask
    return b * _TILE + int(np.flatnonzero(tile == key)[nth - before - 1])


def _device_cut(hi: int, icut: int) -> Any:
    return cupy_or_none().asarray(np.array([hi, icut], dtype=np.int64))


def _count(x: Any, cut: Any) -> tuple[Any, Any, int]:
    """The counting pass of :func:`_compact`: ``(counts per tile, their running sums,
    the total)``; raises if some entry is a NaN."""
    cp = cupy_or_none()
    bits, absmask, infkey = _bits(x)
    n = int(x.shape[0])
    tiles = -(-n // _TILE)
    counts = cp.empty(tiles, dtype=np.uint32)
    flag = cp.zeros(1, dtype=np.uint64)
    args = (bits, np.int64(n), absmask, infkey, cut, counts, flag)
    _kernel(cp, "sc_count", bits.dtype.itemsize)((tiles,), (_BLOCK,), args)
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
        _kernel(cp, "sc_write", bits.dtype.itemsize, itype.itemsize)((tiles,), (_BLOCK,), args)
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
    shift = max(key_bits - _DIGIT, 0)
    hist = _histogram(bits, absmask, infkey, 0, 0, shift)
    if hist[_BINS]:
        raise _nan_error()
    digit, remaining, in_bin = _bin_of(hist, k)
    if in_bin > _CANDIDATES:
        return None
    ut = bits.dtype.type
    tiles = -(-n // _TILE)
    cand = cp.empty(in_bin, dtype=np.uint64)
    ncand = cp.zeros(1, dtype=np.uint64)
    counts = cp.empty(tiles, dtype=np.uint32)
    pmask = ((_BINS - 1) << shift) & ((1 << key_bits) - 1)
    args = (bits, np.int64(n), absmask, ut(pmask), ut(digit << shift), cand, ncand, counts)
    kb = bits.dtype.itemsize
    _kernel(cp, "sc_gather_packed", kb)((tiles,), (_BLOCK,), args)
    cand.sort()
    cut = cp.empty(2, dtype=np.int64)
    grid = -(-remaining // _BLOCK)
    _kernel(cp, "sc_take_packed", kb)(
        (grid,), (_BLOCK,), (cand, np.int64(remaining), absmask, counts, cut)
    )
    ends = cp.cumsum(counts, dtype=np.uint64)
    return _write(x, cut, counts, ends, k)


def flatnonzero_mask(mask: Any) -> Any:
    """``cupy.flatnonzero`` of a contiguous bool vector, as indices of ``index_dtype``: two
    passes over the bytes instead of a 64-bit scan."""
    cp = cupy_or_none()
    n = int(mask.shape[0])
    itype = index_dtype(n)
    tiles = -(-n // _TILE)
    if tiles == 0:
        return cp.zeros(0, dtype=itype)
    counts = cp.empty(tiles, dtype=np.uint32)
    _kernel(cp, "sc_mask_count", 4, itype.itemsize)(
        (tiles,), (_BLOCK,), (mask, np.int64(n), counts)
    )
    ends = cp.cumsum(counts, dtype=np.uint64)
    idx = cp.empty(int(ends[-1]), dtype=itype)
    if idx.shape[0]:
        _kernel(cp, "sc_mask_write", 4, itype.itemsize)(
            (tiles,), (_BLOCK,), (mask, np.int64(n), ends, counts, idx)
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
    t, _ = _cut(x, min(max(int(k), 1), n), early=False, index=False)
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
        body += "v = sc_add(sc_mul(m, u), g); uo = v;\n"
    if has_r:
        body += "v = sc_add(v, r);\n"
    # |v| >= cut compared on the magnitude bits: a subnormal cut (the smallest one stands for
    # "nonzero") must not be flushed to zero (on an H100 a zero acc was selected with it)
    body += """
        acc = v;
        bool ge;
        if (sizeof(T) == 4) {
            ge = (__float_as_uint((float)v) & 0x7fffffffu)
                 >= (__float_as_uint((float)cut) & 0x7fffffffu);
        } else {
            ge = ((unsigned long long)__double_as_longlong((double)v) & 0x7fffffffffffffffull)
                 >= ((unsigned long long)__double_as_longlong((double)cut) & 0x7fffffffffffffffull);
        }
        sel = ge && !isnan(v);
        if (!isfinite(v)) atomicAdd((unsigned long long*)&bad[0], 1ULL);
    """
    # sc_add/sc_mul (IEEE_ARITHMETIC): m*u + g rounded twice, as numpy and the CPU pass do
    # (a fused multiply-add rounds once: 1 ulp off the CPU's result, seen on an H100), and
    # subnormals kept under CuPy's -ftz=true; --fmad=false keeps any other product unfused
    return cp.ElementwiseKernel(
        ", ".join(ins),
        ", ".join(outs),
        body,
        "sparsecoll_accumulate",
        options=("--fmad=false",),
        preamble=IEEE_ARITHMETIC,
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


@functools.cache
def _widen_kernel(cp: Any) -> Any:
    return cp.ElementwiseKernel(
        "float32 x, float64 s, float64 c",
        "float64 d",
        "d = sc_add(sc_mul(sc_widen(x), s), -c);",
        "sparsecoll_widen",
        preamble=IEEE_ARITHMETIC,
    )


def shifted_float64(x: Any, shift: float, scale: float) -> Any:
    """``x·scale - shift·scale`` in float64 for a float32 x, rounded as on the host
    (see ``_common.shifted_float64``), its subnormals kept."""
    cp = cupy_or_none()
    d = cp.empty(x.shape, dtype=np.float64)
    if x.size:
        _widen_kernel(cp)(x, np.float64(scale), np.float64(shift * scale), d)
    return d
