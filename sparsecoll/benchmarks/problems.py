"""Synthetic sparse-allreduce inputs, the same on every launcher and documented by name.

Overlap patterns (k = density·n nonzeros per rank):
  random    each rank draws its indices uniformly at random, independently;
  same      every rank holds the same indices (no build-up);
  disjoint  rank r draws from its own slice of [0, n) (maximum build-up);
  skewed    90% of the indices fall in the first 10% of [0, n).
"""

from __future__ import annotations

import numpy as np

from .._array import index_dtype

__all__ = ["OVERLAPS", "OVERLAP_HELP", "make_problem"]

OVERLAPS = ("random", "same", "disjoint", "skewed")
OVERLAP_HELP = (  # for argparse (%% is a literal %)
    "how the ranks' indices relate: random (independent draws), same, disjoint (a slice "
    "each), skewed (90%% in the first 10%% of n); default random"
)


def _distinct(rng: np.random.Generator, lo: int, hi: int, k: int) -> np.ndarray:
    """About k distinct sorted integers in [lo, hi) (exactly k when k << hi - lo)."""
    span = hi - lo
    k = min(k, span)
    if k == 0:
        return np.zeros(0, np.int64)
    if k > span // 4:
        return np.sort(rng.choice(span, size=k, replace=False)) + lo
    out = np.unique(rng.integers(0, span, size=k + k // 8 + 8))
    if out.shape[0] > k:
        out = np.sort(rng.choice(out, size=k, replace=False))
    return out + lo


def make_problem(
    n: int,
    density: float,
    rank: int,
    size: int,
    overlap: str = "random",
    dtype: object = np.float32,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """This rank's (values, indices) for the named overlap pattern."""
    if overlap not in OVERLAPS:
        raise ValueError(f"unknown overlap {overlap!r}; known: {', '.join(OVERLAPS)}")
    k = round(density * n)
    rng = np.random.default_rng([seed, rank])
    if overlap == "random":
        idx = _distinct(rng, 0, n, k)
    elif overlap == "same":
        idx = _distinct(np.random.default_rng([seed, 1 << 20]), 0, n, k)
    elif overlap == "disjoint":
        lo, hi = rank * n // size, (rank + 1) * n // size
        idx = _distinct(rng, lo, hi, k)
    else:
        hot = max(1, n // 10)
        k_hot = int(0.9 * k)
        idx = np.union1d(_distinct(rng, 0, hot, k_hot), _distinct(rng, hot, n, k - k_hot))
    vals = rng.standard_normal(idx.shape[0]).astype(dtype)
    return vals, idx.astype(index_dtype(n))
