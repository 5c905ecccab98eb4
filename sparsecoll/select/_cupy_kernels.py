"""The CUDA code of the GPU selection (``_cupy``): the raw kernels (radix histogram, gather,
compaction) for each key and index width, and the elementwise kernels of the fused
error-feedback pass and of the float32 -> float64 widening. A leaf: it imports no other
selection module.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .._array import IEEE_ARITHMETIC, cupy_or_none

__all__ = [
    "BINS",
    "BLOCK",
    "DIGIT",
    "HIST_BLOCK",
    "ITEMS",
    "KERNEL_OPTIONS",
    "TILE",
    "accumulate_kernel",
    "kernel",
    "kernel_source",
    "module",
    "shifted_float64",
    "widen_kernel",
]

DIGIT = 12  # bits of the key fixed per histogram pass
BINS = 1 << DIGIT
BLOCK = 256  # threads of a compaction block
ITEMS = 16  # entries per thread: a compaction tile is 4096 entries
TILE = BLOCK * ITEMS
HIST_BLOCK = 512
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
        .replace("BINS_V", str(BINS))
        .replace("BLOCK_V", str(BLOCK))
        .replace("ITEMS_V", str(ITEMS))
    )


KERNEL_OPTIONS = ("--std=c++14",)


@functools.cache
def module(cp: Any, key_bytes: int, index_bytes: int) -> Any:
    return cp.RawModule(code=kernel_source(key_bytes, index_bytes), options=KERNEL_OPTIONS)


def kernel(cp: Any, name: str, key_bytes: int, index_bytes: int = 8) -> Any:
    return module(cp, key_bytes, index_bytes).get_function(name)


@functools.cache
def accumulate_kernel(cp: Any, has_r: bool, has_u: bool) -> Any:
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


@functools.cache
def widen_kernel(cp: Any) -> Any:
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
        widen_kernel(cp)(x, np.float64(scale), np.float64(shift * scale), d)
    return d
