"""Threshold windows: counts at geometric edges around a threshold, and the edge nearest k.

Used by exdyna (every call) and oktopk (reuse calls): each rank counts its magnitudes at the
E edges of :func:`window_edges`, one small collective gathers the counts, and every rank runs
:func:`pick_edge` (exdyna) or :func:`bracket_edge` (oktopk) on the same totals, so every rank
picks the same edge.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from .._array import get_array_module, to_host
from ..select import backend
from ..select._common import key_info, magnitude_keys, magnitudes

__all__ = [
    "WINDOW_OFFSETS", "bracket_edge", "bucket_shares", "bucket_start", "edge_counts",
    "edge_totals", "nudged_up", "pick_edge", "window_edges",
]  # fmt: skip

# log-offsets of the threshold window: step 0.003 in the middle, ±0.223 (×1.25) at the ends
_J = np.arange(-32, 33, dtype=np.float64)
WINDOW_OFFSETS = 0.003 * _J + (math.log(1.25) - 0.096) / 32**3 * _J**3


def window_edges(threshold: float, dtype: Any) -> np.ndarray:
    """Return the 65 edges ``threshold·e^{WINDOW_OFFSETS}`` in ``dtype`` (inf past its range)."""
    with np.errstate(over="ignore"):
        return (threshold * np.exp(WINDOW_OFFSETS)).astype(dtype)


def nudged_up(threshold: float, factor: float) -> float:
    """Return ``threshold·factor`` held to the largest float (inf would never come back down)."""
    return min(threshold * factor, sys.float_info.max)


def edge_counts(mags: Any, edges: np.ndarray) -> tuple[Any, np.ndarray]:
    """Return ``(h, ge)`` for non-negative ``mags``, in one pass over them.

    ``h``: how many edges are <= each magnitude (``h > j`` selects ``mags >= edges[j]``);
    ``ge[j]``: #(mags >= edges[j]), host int64.
    """
    xp = get_array_module(mags)
    if xp is np and backend() == "numba":
        from ..select._numba_edges import bucketize

        h = bucketize(mags, edges)
    elif xp is not np and edges.dtype == mags.dtype:
        # on keys, which order as the magnitudes do: CuPy's float32 compare flushes
        # subnormal magnitudes and edges to 0 (select._common)
        ut = key_info(mags.dtype).utype
        h = xp.searchsorted(xp.asarray(edges.view(ut)), magnitude_keys(mags), side="right")
    else:
        h = xp.searchsorted(xp.asarray(edges), mags, side="right")
    hist = to_host(xp.bincount(h, minlength=edges.shape[0] + 1)).astype(np.int64)
    return h, np.ascontiguousarray(np.cumsum(hist[::-1])[::-1][1:])


def edge_totals(x: Any, edges: np.ndarray) -> np.ndarray:
    """Return ``ge[j]`` = #(|x| >= edges[j]) (host int64): :func:`edge_counts` without ``h``."""
    if isinstance(x, np.ndarray) and backend() == "numba":
        from ..select._numba_edges import count_at_edges

        return count_at_edges(x, edges)
    return edge_counts(magnitudes(x), edges)[1]


def pick_edge(total: np.ndarray, k: int, tol: float) -> tuple[int, bool]:
    """Return ``(j, missed)``: the edge whose global count is nearest ``k`` (ties: the middle one).

    ``missed``: k lies outside the window by more than ``tol`` (j is then the nearer end).
    """
    if total[-1] > k + tol:  # too many even at the highest edge: the window is too low
        return total.shape[0] - 1, True
    if total[0] < k - tol:  # too few even at the lowest edge: the window is too high
        return 0, True
    miss = np.abs(np.asarray(total, dtype=np.int64) - k)
    best = np.flatnonzero(miss == miss.min())
    return int(best[best.shape[0] // 2]), False


def bracket_edge(total: np.ndarray, k: int) -> int | None:
    """Return the highest edge j with ``total[j] >= k`` (the k-th largest is above it), or None."""
    if total[0] < k or total[-1] > k:
        return None
    return int(np.flatnonzero(np.asarray(total) >= k)[-1])


def bucket_start(step: int, total: int) -> int:
    """Return where a window call starts taking its bucket of ``total``: frac(step·φ)·total.

    Successive calls start far apart and every position comes round evenly.
    """
    return ((step * 0x9E3779B97F4A7C15) & (2**64 - 1)) * total >> 64


def bucket_shares(bucket: Any, need: int, start: int) -> list[tuple[tuple[int, int], ...]]:
    """Split a run of ``need`` bucket entries from ``start`` (wrapping) among the parts.

    ``bucket[i]`` entries lie in part i, in index order. Per part: at most two ``(start,
    stop)`` ranges of its own positions, as :func:`._merge.keep_bucket` takes them.
    """
    counts = [int(c) for c in bucket]
    total = sum(counts)
    runs = [(start, min(start + need, total)), (0, max(start + need - total, 0))]
    shares, s = [], 0
    for c in counts:
        e = s + c
        shares.append(
            tuple((max(a, s) - s, min(b, e) - s) for a, b in runs if min(b, e) > max(a, s))
        )
        s = e
    return shares
