"""Synthetic sparse-allreduce inputs, the same on every launcher and documented by name.

Overlap patterns (k = density·n distinct nonzeros per rank, sorted):
  random    each rank draws its indices uniformly at random, independently;
  same      every rank holds the same indices (no build-up);
  disjoint  rank r draws from its own slice of [0, n) (maximum build-up);
  skewed    90% of the indices fall in the first 10% of [0, n);
  hot       80% fall in the first 1/P of [0, n), the rest uniformly in the other (P−1)/P:
            the owner of the first of P equal ranges gets most of the traffic;
  zipf      index i drawn with weight (i + 1)^−1.1, without replacement: popular rows of
            an embedding sorted by frequency, shared by the ranks, at the low end;
  tokens    as zipf, with the token frequencies of bench/train_cluster.py's corpus
            (``_tokens``), its rank axis stretched to n (row i: the token of rank ⌊i·V/n⌋).
Weighted patterns sample exactly k without replacement (Efraimidis–Spirakis keys E_i/w_i,
the k smallest), O(n) per rank. Every pattern is deterministic per (seed, rank).
"""

from __future__ import annotations

import functools

import numpy as np

from .._array import index_dtype

__all__ = ["HOT_SHARE", "OVERLAPS", "OVERLAP_HELP", "ZIPF_EXPONENT", "make_problem", "weights"]

OVERLAPS = ("random", "same", "disjoint", "skewed", "hot", "zipf", "tokens")
OVERLAP_HELP = (  # for argparse (%% is a literal %)
    "how the ranks' indices relate: random (independent draws), same, disjoint (a slice "
    "each), skewed (90%% in the first 10%% of n), hot (80%% in the first 1/P of n), zipf "
    "(row i drawn with weight (i+1)^-1.1), tokens (real token frequencies); default random"
)
HOT_SHARE = 0.8  # of each rank's nonzeros in the hot range
ZIPF_EXPONENT = 1.1


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


@functools.lru_cache(maxsize=1)
def _token_counts() -> np.ndarray:
    """The corpus's token counts, most frequent first."""
    from ._tokens import COUNTS

    runs = [w.partition("*") for w in COUNTS.split()]
    return np.repeat([int(c) for c, _, _ in runs], [int(m or 1) for _, _, m in runs])


def weights(overlap: str, n: int, at: np.ndarray) -> np.ndarray:
    """Relative popularity of the indices ``at`` of [0, n) under zipf or tokens (float64)."""
    at = np.asarray(at, dtype=np.int64)
    if overlap == "zipf":
        return (at + 1.0) ** -ZIPF_EXPONENT
    if overlap == "tokens":
        counts = _token_counts()
        return counts[at * counts.shape[0] // n].astype(np.float64)
    raise ValueError(f"{overlap!r} is not a weighted pattern")


@functools.lru_cache(maxsize=2)
def _inverse_weights(overlap: str, n: int) -> np.ndarray:
    """1 / weight of each index of [0, n) (float32, read-only; cached: a process's calls
    share it)."""
    if overlap == "zipf":  # (float32 throughout: a fifth of float64's time)
        out = np.arange(1, n + 1, dtype=np.float32)
        out **= np.float32(ZIPF_EXPONENT)
    else:
        counts = _token_counts()
        out = (1.0 / counts.astype(np.float32))[np.arange(n) * counts.shape[0] // n]
    out.flags.writeable = False
    return out


def _weighted(rng: np.random.Generator, overlap: str, n: int, k: int) -> np.ndarray:
    """k distinct sorted indices of [0, n), drawn without replacement by weight."""
    if k >= n:
        return np.arange(n, dtype=np.int64)
    if k <= 0:
        return np.zeros(0, np.int64)
    key = rng.standard_exponential(n, dtype=np.float32)
    key *= _inverse_weights(overlap, n)
    cut = np.partition(key, k - 1)[k - 1]
    keep = key < cut
    ties = np.flatnonzero(key == cut)  # (float32 keys can tie at the cut)
    keep[ties[: k - int(np.count_nonzero(keep))]] = True
    return np.flatnonzero(keep)


def _hot(rng: np.random.Generator, n: int, k: int, size: int) -> np.ndarray:
    hot = max(1, n // max(size, 1))
    k_hot = min(round(HOT_SHARE * k), hot)
    k_rest = min(k - k_hot, n - hot)
    k_hot = min(k - k_rest, hot)  # (a full hot range moves the excess out, and back)
    return np.concatenate([_distinct(rng, 0, hot, k_hot), _distinct(rng, hot, n, k_rest)])


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
    elif overlap == "skewed":
        hot = max(1, n // 10)
        k_hot = int(0.9 * k)
        idx = np.union1d(_distinct(rng, 0, hot, k_hot), _distinct(rng, hot, n, k - k_hot))
    elif overlap == "hot":
        idx = _hot(rng, n, k, size)
    else:
        idx = _weighted(rng, overlap, n, k)
    vals = rng.standard_normal(idx.shape[0]).astype(dtype)
    return vals, idx.astype(index_dtype(n))
