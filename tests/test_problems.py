"""The benchmarks' overlap patterns (sparsecoll.benchmarks.problems): k distinct sorted
indices per rank, deterministic per (seed, rank), and the skew each pattern promises."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from sparsecoll.algorithms.base import range_bounds
from sparsecoll.benchmarks.problems import HOT_SHARE, OVERLAP_HELP, OVERLAPS, make_problem

N = 1 << 18


def _draws(overlap: str, P: int, density: float = 0.01, n: int = N) -> list[np.ndarray]:
    return [make_problem(n, density, r, P, overlap)[1].astype(np.int64) for r in range(P)]


def _range_imbalance(every: list[np.ndarray], n: int, P: int) -> float:
    """max/mean of all ranks' nonzeros over the P ranges of a range split (dsa's)."""
    loads = sum(np.diff(np.searchsorted(i, range_bounds(n, P))) for i in every)
    return float(loads.max() / loads.mean())


def test_the_patterns_are_listed_and_documented():
    assert OVERLAPS == ("random", "same", "disjoint", "skewed", "hot", "zipf", "tokens")
    for name in OVERLAPS:
        assert name in OVERLAP_HELP
    OVERLAP_HELP % ()  # (argparse formats it: every % doubled)
    with pytest.raises(ValueError, match="unknown overlap 'zip'; known: random, .*, tokens"):
        make_problem(N, 0.01, 0, 2, "zip")


@pytest.mark.parametrize("overlap", OVERLAPS)
@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
def test_k_distinct_sorted_indices_in_range(overlap, density):
    k = round(density * N)
    for P in (2, 5):
        for r in range(P):
            vals, idx = make_problem(N, density, r, P, overlap, np.float64, seed=3)
            assert idx.dtype == np.int32 and vals.dtype == np.float64
            assert idx.shape == vals.shape == (k,), (overlap, P, r)
            assert (np.diff(idx) > 0).all() and idx[0] >= 0 and idx[-1] < N
            again = make_problem(N, density, r, P, overlap, np.float64, seed=3)
            assert np.array_equal(again[1], idx) and np.array_equal(again[0], vals)
    other = make_problem(N, density, 0, 2, overlap, seed=4)[1]
    assert not np.array_equal(other, make_problem(N, density, 0, 2, overlap, seed=3)[1])


@pytest.mark.parametrize("overlap", ["hot", "zipf", "tokens"])
def test_tiny_and_full_densities(overlap):
    for n, density in ((1, 1.0), (10, 0.5), (1000, 1.0), (1000, 0.0)):
        idx = make_problem(n, density, 1, 3, overlap)[1]
        assert idx.shape == (round(n * density),) and (np.diff(idx) > 0).all()
        assert idx.size == 0 or idx[-1] < n


def test_hot_puts_its_share_in_the_first_range():
    for P in (2, 4, 8):
        k = round(0.01 * N)
        for idx in _draws("hot", P):
            assert np.count_nonzero(idx < N // P) == round(HOT_SHARE * k)
    # the hot range overflows at 10% and P = 16: what does not fit goes to the rest
    idx = make_problem(1600, 0.1, 0, 16, "hot")[1]
    assert idx.size == 160 and np.count_nonzero(idx < 100) == 100


@pytest.mark.parametrize("overlap", ["zipf", "tokens"])
def test_weighted_patterns_share_a_popular_low_end(overlap):
    """Frequent indices are at the low end and every rank holds them; the union is far
    smaller than independent draws give."""
    P = 8
    every = _draws(overlap, P)
    k = every[0].size
    head = np.arange(16)  # the most frequent rows: on every rank
    for idx in every:
        assert np.isin(head, idx).all()
        assert np.count_nonzero(idx < N // 10) > 0.3 * k
    union = np.unique(np.concatenate(every)).size
    independent = np.unique(np.concatenate(_draws("random", P))).size
    assert union < 0.8 * independent


@pytest.mark.parametrize(("overlap", "low", "high"), [
    ("random", 1.0, 1.1),
    ("same", 1.0, 1.1),
    ("hot", 0.8 * 8 - 0.5, 0.8 * 8 + 0.5),
    ("skewed", 6.0, 8.0),
    ("zipf", 3.0, 8.0),
    ("tokens", 3.0, 8.0),
])  # fmt: skip
def test_range_split_imbalance_at_8_ranks(overlap, low, high):
    """max/mean load of a range split over 8 ranks: what auto measures and dsa suffers."""
    assert low <= _range_imbalance(_draws(overlap, 8), N, 8) <= high


def test_every_entry_point_with_overlap_accepts_the_new_patterns():
    from sparsecoll.benchmarks.cli import RankZeroParser, choices_arg

    p = RankZeroParser()
    p.add_argument("--overlap", type=choices_arg(OVERLAPS, "overlap"))
    assert p.parse_args(["--overlap", "hot,zipf,tokens"]).overlap == ["hot", "zipf", "tokens"]
    q = argparse.ArgumentParser()
    q.add_argument("--overlap", choices=OVERLAPS, help=OVERLAP_HELP)
    assert q.parse_args(["--overlap", "tokens"]).overlap == "tokens"
    q.format_help()


def test_the_token_counts_are_the_corpus_profile():
    """_tokens holds the counts its docstring describes, most frequent first."""
    import re

    from sparsecoll.benchmarks import _tokens
    from sparsecoll.benchmarks.problems import _token_counts

    counts = _token_counts()
    tokens, distinct = map(
        int, re.search(r"(\d+) tokens, (\d+) distinct", _tokens.__doc__).groups()
    )
    assert counts.sum() == tokens and counts.size == distinct
    assert (np.diff(counts) <= 0).all() and counts[-1] >= 1
