"""Numba kernels of the oktopk threshold window: bucketing and counts at edges."""

from __future__ import annotations

import math

import numpy as np

from .._jit import cached_njit

__all__ = ["bucketize", "count_at_edges"]


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
