"""How the selecting algorithms cut the index space [0, n) among the ranks.

oktopk: contiguous regions balanced on the incoming entries, from equal-count index samples
of every rank (:func:`index_samples`, :func:`balanced_boundaries`). exdyna: fine-grained
blocks grouped into P partitions, one block moved between neighbours whose counts straddle
the mean (:func:`rebalance`). Every function is deterministic: every rank computes the same
boundaries from the same gathered data.
"""

from __future__ import annotations

import numpy as np

from .base import range_bounds

__all__ = ["balanced_boundaries", "index_samples", "rebalance", "sample_segments"]


def sample_segments(size: int) -> int:
    """Split points each rank contributes to the region balancing: ``max(8·size, 64)``.

    A boundary's count is off by at most ``total/segments + size`` from its target (one
    segment per rank, plus rounding, the copies of one index on many ranks among it: no
    boundary splits them), so a region is within ``2·size/segments + 2·size/k̄`` of the
    mean in the worst case (k̄ = total/size, the mean entries per rank): at most 25% from
    the segments, plus the rounding's share, small only while k̄ is large against size
    (every rank's segment misjudged the same way at a cliff in the index density; far
    closer on smooth densities). It costs ``size·(segments + 2)`` int64 per rank, once
    every ``tau_prime`` calls.
    """
    return max(8 * size, 64)


def index_samples(indices: np.ndarray, segments: int) -> np.ndarray:
    """``[count, p_0, ..., p_segments]``: equal-count split points of sorted unique ``indices``.

    ``p_0`` is the first index, ``p_segments`` one past the last, and exactly
    ``floor(j·count/segments)`` indices lie below ``p_j`` (all zeros when count is 0).
    """
    c = int(indices.shape[0])
    out = np.zeros(segments + 2, dtype=np.int64)
    out[0] = c
    if c:
        j = np.arange(1, segments, dtype=np.int64)
        out[1] = indices[0]
        out[2:-1] = indices[(j * c) // segments]
        out[-1] = int(indices[-1]) + 1
    return out


def balanced_boundaries(samples: np.ndarray, n: int, parts: int) -> np.ndarray:
    """``parts + 1`` int64 region boundaries from every rank's :func:`index_samples` rows.

    The summed CDF of the ranks' piecewise-linear index distributions is inverted at
    ``j·total/parts``; equal-width regions when no rank has an entry. Deterministic, so every
    rank computes the same boundaries from the same gathered samples.
    """
    samples = np.asarray(samples, dtype=np.int64)
    counts = samples[:, 0]
    total = int(counts.sum())
    if total == 0 or parts == 1:
        return range_bounds(n, parts)
    segments = samples.shape[1] - 2
    live = samples[counts > 0]
    cum = [
        np.concatenate(([0], (np.arange(1, segments, dtype=np.int64) * c) // segments, [c]))
        for c in live[:, 0]
    ]
    # in float64 as offsets from the lowest sample (exact while the sampled span is below
    # 2**53, however large the indices: near 2**63 absolute positions are 1024 apart and
    # round to 2**63.0, which has no int64), back to integers in Python ints
    base = int(live[:, 1].min())
    offsets = [(row[1:] - base).astype(np.float64) for row in live]
    xs = np.unique(np.concatenate(offsets))
    cdf = np.zeros(xs.shape[0])
    for off, cm in zip(offsets, cum):
        cdf += np.interp(xs, off, cm.astype(np.float64), 0.0, float(cm[-1]))
    targets = np.arange(1, parts, dtype=np.float64) * total / parts
    inner = np.rint(np.interp(targets, cdf, xs))
    bounds = np.empty(parts + 1, dtype=np.int64)
    bounds[0], bounds[-1] = 0, n
    bounds[1:-1] = [min(base + int(v), n) for v in inner.tolist()]
    return np.maximum.accumulate(bounds)


def rebalance(bounds: np.ndarray, counts: np.ndarray, tolerance: float) -> np.ndarray:
    """Move one boundary block between neighbouring partitions whose counts straddle the mean.

    ``bounds`` are P + 1 block boundaries, ``counts`` the selected counts per partition.
    A partition above ``(1 + tolerance)·mean`` gives its edge block to a neighbour below
    ``(1 − tolerance)·mean``; pairs are visited left to right, and no partition drops below
    one block. Deterministic: every rank computes the same bounds from the same counts.
    """
    b = np.array(bounds, dtype=np.int64)
    c = np.asarray(counts, dtype=np.float64)
    p = c.shape[0]
    mean = float(c.sum()) / p if p else 0.0
    hi, lo = mean * (1 + tolerance), mean * (1 - tolerance)
    for j in range(p - 1):
        if c[j] > hi and c[j + 1] < lo and c[j] - mean >= 1 and b[j + 1] - b[j] > 1:
            b[j + 1] -= 1
        elif c[j + 1] > hi and c[j] < lo and c[j + 1] - mean >= 1 and b[j + 2] - b[j + 1] > 1:
            b[j + 1] += 1
    return b
