"""The threshold-window helpers shared by exdyna and oktopk, against direct counts."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparsecoll.algorithms._window import (
    WINDOW_OFFSETS,
    bracket_edge,
    edge_counts,
    edge_totals,
    pick_edge,
    window_edges,
)
from sparsecoll.select import _numba_edges
from sparsecoll.select._numba_edges import EDGE_BINS


def test_edges_ascend_around_the_threshold():
    e = window_edges(2.0, np.float64)
    assert e.shape == WINDOW_OFFSETS.shape == (65,)
    assert np.all(np.diff(e) > 0)
    assert e[32] == 2.0
    assert np.isclose(e[0], 2.0 / 1.25) and np.isclose(e[-1], 2.0 * 1.25)


@given(
    mags=st.lists(st.floats(0, 4, width=32), max_size=200),
    t=st.floats(0.5, 3),
    dtype=st.sampled_from([np.float16, np.float32, np.float64]),
)
def test_edge_counts_match_direct_comparisons(mags, t, dtype):
    m = np.abs(np.asarray(mags, dtype=dtype))
    edges = window_edges(t, dtype)
    h, ge = edge_counts(m, edges)
    assert np.array_equal(edge_totals(m, edges), ge)
    for j in range(edges.shape[0]):
        assert ge[j] == np.count_nonzero(m >= edges[j])
        assert np.array_equal(h > j, m >= edges[j])


@given(
    seed=st.integers(0, 2**32 - 1),
    # tiny thresholds: edges of subnormals, some equal (the count's fallback)
    t=st.one_of(st.floats(1e-3, 1e3), st.floats(1e-45, 1e-36)),
    dtype=st.sampled_from([np.float16, np.float32, np.float64]),
)
def test_edge_totals_of_many_magnitudes(seed, t, dtype):
    """Past EDGE_BINS magnitudes the count places each one with linear bins: still exact
    at the edges themselves, one ulp either side, 0, inf, NaN and far outside the window."""
    rng = np.random.default_rng(seed)
    # as oktopk and exdyna build them: an edge that rounds to 0 is the least subnormal
    edges = np.maximum(window_edges(t, dtype), np.finfo(dtype).smallest_subnormal)
    m = int(rng.integers(EDGE_BINS, 3 * EDGE_BINS))
    mags = np.abs(rng.standard_normal(m) * t).astype(dtype)
    at = edges[rng.integers(0, edges.shape[0], m // 4)]
    near = [at, np.nextafter(at, dtype(0)), np.nextafter(at, dtype(np.inf))]
    mags[: 3 * at.shape[0]] = np.concatenate(near)
    mags[-4:] = [0, np.inf, edges[-1] * 4, np.nan]
    ge = edge_totals(rng.permutation(mags), edges)
    assert np.array_equal(ge, [np.count_nonzero(mags >= e) for e in edges])
    signs = np.where(rng.random(m) < 0.5, -1, 1).astype(dtype)
    assert np.array_equal(edge_totals(mags * signs, edges), ge)  # counts of |x|


@contextlib.contextmanager
def one_binned_pass() -> Iterator[None]:
    """Inside: count_at_edges may not fall back to its pass per edge (the binned pass)."""
    one_pass = _numba_edges._count_at_edges

    def per_edge(x, edges, out):  # (one distinct edge: one pass either way)
        assert edges.shape[0] == 1, f"a pass per edge, {edges.shape[0]} of them"
        one_pass(x, edges, out)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_numba_edges, "_count_at_edges", per_edge)
        yield


@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from([np.float16, np.float32, np.float64]),
    ulps=st.integers(2, 2**40),
)
def test_edge_totals_of_subnormals_in_one_pass(seed, dtype, ulps):
    """Subnormal data, windows of edges that round together (some equal) or lie closer
    than float64 can bin (float64's subnormals): still one binned pass, not a pass per
    edge (before: 65 passes, ~5x slower at 1M float64 magnitudes), and exact."""
    fi = np.finfo(dtype)
    ulps = min(ulps, 2**fi.nmant - 1)  # |values| up to that many of the least subnormal
    rng = np.random.default_rng(seed)
    m = int(rng.integers(EDGE_BINS, 3 * EDGE_BINS))
    mags = np.ceil(rng.random(m) * ulps) * float(fi.smallest_subnormal)
    mags = mags.astype(dtype) * np.where(rng.random(m) < 0.5, -1, 1).astype(dtype)
    mags[-3:] = [0, np.inf, fi.max]
    t = float(np.sort(np.abs(mags))[m - m // 100])
    edges = np.maximum(window_edges(t, dtype), fi.smallest_subnormal)
    want = [np.count_nonzero(np.abs(mags) >= e) for e in edges]

    with one_binned_pass():
        assert np.array_equal(edge_totals(mags, edges), want)


@pytest.mark.filterwarnings("error")
@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from([np.float16, np.float32, np.float64]),
    at=st.floats(0.85, 1.0),  # (the top edge, t·1.25, past the largest finite value)
    infs=st.integers(0, 5),
)
def test_edge_totals_past_the_largest_finite_value_in_one_pass(seed, dtype, at, infs):
    """A window around a threshold near the dtype's largest finite value: its top edges
    round to inf (only infinities reach them). Exact, and one binned pass, the infinities
    in a bin of their own (before: hi = inf ruled the bins out, a pass per edge, 58 of them
    at t = 3e38 in float32; and window_edges warned of the overflow)."""
    fi = np.finfo(dtype)
    rng = np.random.default_rng(seed)
    m = int(rng.integers(EDGE_BINS, 3 * EDGE_BINS))
    t = float(fi.max) * at
    mags = (rng.uniform(0.7, 1.0, m) * float(fi.max)).astype(dtype)
    mags[:infs] = np.inf
    mags[infs : infs + 3] = fi.max
    mags = rng.permutation(mags) * np.where(rng.random(m) < 0.5, -1, 1).astype(dtype)
    edges = window_edges(t, dtype)
    assert np.isinf(edges[-1])
    want = [np.count_nonzero(np.abs(mags) >= e) for e in edges]

    with one_binned_pass():
        assert np.array_equal(edge_totals(mags, edges), want)


@given(total=st.lists(st.integers(0, 50), min_size=65, max_size=65), k=st.integers(1, 60))
def test_bracket_edge(total, k):
    total = np.sort(np.asarray(total))[::-1]  # counts fall as the edge rises
    j = bracket_edge(total, k)
    if total[0] < k or total[-1] > k:
        assert j is None
    else:
        assert total[j] >= k and (j == 64 or total[j + 1] < k)


def test_pick_edge_nearest_k_and_misses():
    total = np.array([30, 20, 12, 10, 10, 10, 8, 0])
    assert pick_edge(total, 10, 0.5) == (4, False)  # the middle of the tied best
    assert pick_edge(total, 40, 0.5) == (0, True)
    assert pick_edge(total + 5, 3, 0.5) == (7, True)


@given(
    st.integers(0, 2**32 - 1),
    st.integers(0, 3000),
    st.floats(0.0, 1.0),
    st.sampled_from([np.float16, np.float32, np.float64]),
    st.integers(0, 4000),
)
def test_derive_takes_the_largest_nonzero_magnitudes(seed, m, nonzero, dtype, take):
    """exdyna's re-derive input: the take largest nonzero |values| (as a sorted multiset,
    what a partition of |part| gives), on dense, mostly-zero and tied parts; a NaN (the
    largest key) is among them whenever one is taken (the derive reports it on every rank)."""
    from sparsecoll.algorithms._exdyna_threshold import _top_magnitudes

    rng = np.random.default_rng(seed)
    part = np.where(rng.random(m) < nonzero, rng.integers(-3, 4, m) * rng.random(m), 0)
    part = part.astype(dtype)
    take = min(take, m)
    mags = np.abs(part).astype(np.float64)
    want = np.sort(mags)[m - take :]
    assert np.array_equal(np.sort(_top_magnitudes(part, take)), want[want > 0])
    if m:
        part[rng.integers(m)] = np.nan
        got = _top_magnitudes(part, take)
        assert bool(np.isnan(got).any()) == (take > 0) and got.shape[0] <= take


def test_bucket_start_moves_over_the_whole_bucket():
    """oktopk's window calls start taking their bucket at bucket_start(step, size): always a
    position of the bucket, and over `size` calls most positions come round (golden-ratio
    steps, no stuck start)."""
    from sparsecoll.algorithms.oktopk import bucket_start

    assert bucket_start(7, 0) == 0
    for size in (1, 2, 7, 41, 1000, 2**40):
        starts = [bucket_start(step, size) for step in range(min(size, 2000))]
        assert all(0 <= s < size for s in starts)
        assert len(set(starts)) >= 0.7 * len(starts)


@given(
    seed=st.integers(0, 2**32 - 1),
    k=st.integers(1, 3000),
    low=st.floats(-0.3, 0.2),
    spread=st.floats(0.01, 0.6),
    dtype=st.sampled_from([np.float16, np.float32, np.float64]),
    special=st.sampled_from(["none", "zero", "nan", "inf", "edges"]),
    step=st.integers(0, 10**6),
)
def test_oktopk_window_of_one_rank_keeping_all(seed, k, low, spread, dtype, special, step):
    """With one rank whose region holds exactly k entries (P = 1 after a local top-k),
    oktopk's window call takes the short way (no count at every edge, no keep pass); it
    must give what the counts give: the same fallback, kept entries, mask, counts, edges
    and bucket start."""
    from mpi4py import MPI

    import sparsecoll

    rng = np.random.default_rng(seed)
    alg = sparsecoll.get_algorithm("oktopk", k=k)
    alg.threshold, alg.step = float(rng.uniform(0.5, 2.0)), step
    edges = np.maximum(window_edges(alg.threshold, dtype), np.finfo(dtype).smallest_subnormal)
    # magnitudes from around the window's lowest edge (below it: a fallback) up
    mags = alg.threshold * np.exp(rng.uniform(low, low + spread, k))
    vals = (mags * rng.choice([-1.0, 1.0], k)).astype(dtype)
    at = rng.integers(0, k, size=max(1, k // 50))
    if special == "edges":  # entries exactly at edges (ties with the comparisons)
        vals[at] = rng.choice(edges, at.shape[0])
    elif special != "none":
        vals[at] = {"zero": 0.0, "nan": np.nan, "inf": np.inf}[special]
    idx = np.sort(rng.choice(10 * k, k, replace=False)).astype(np.int32)
    comm = sparsecoll.Communicator(MPI.COMM_SELF)
    short = alg._window_keeping_all(idx, vals, edges)
    counted = alg._window_counted(comm, idx, vals, edges)
    assert (short is None) == (counted is None)
    if short is None:
        return
    for a, b in zip(short[:3], counted[:3]):
        assert np.array_equal(a, b)
    assert not np.shares_memory(short[0], idx) and not np.shares_memory(short[1], vals)
    assert short[3:] == counted[3:]
