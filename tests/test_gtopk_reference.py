"""The pieces the selecting algorithms are built on, checked in-process against brute force:
top-k selection, the sequential gtopk tree (the reference the MPI tests compare with) and
oktopk's balanced region boundaries."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from sparsecoll import SparseVector
from sparsecoll._array import index_dtype
from sparsecoll.algorithms._partitions import balanced_boundaries, index_samples, sample_segments
from sparsecoll.algorithms.base import range_bounds
from sparsecoll.algorithms.gtopk import gtopk_tree, merge_topk, topk_positions
from sparsecoll.sparse import coalesce

DTYPES = st.sampled_from([np.float16, np.float32, np.float64])


def brute_topk(values: np.ndarray, k: int) -> list[int]:
    """Positions of the k largest |values|, ties by lower position, zeros never."""
    order = sorted((-abs(float(v)), i) for i, v in enumerate(values) if v != 0)
    return sorted(i for _, i in order[:k])


@given(
    values=hnp.arrays(
        DTYPES,
        st.integers(0, 200),
        # few distinct values: many ties, zeros and signs
        elements=st.sampled_from([0.0, 1.0, -1.0, 2.0, -2.0, 0.5, 3.0]),
    ),
    k=st.integers(0, 250),
)
def test_topk_positions_ties_and_zeros(values, k):
    assert topk_positions(values, k).tolist() == brute_topk(values, k)


@given(
    values=hnp.arrays(np.float64, st.integers(0, 300), elements=st.floats(-1e6, 1e6)),
    k=st.integers(0, 300),
)
def test_topk_positions_floats(values, k):
    assert topk_positions(values, k).tolist() == brute_topk(values, k)


@st.composite
def rank_inputs(draw):
    size = draw(st.integers(1, 9))
    n = draw(st.sampled_from([1, 5, 40, 1000, 2**33]))
    dtype = draw(DTYPES)
    seed = draw(st.integers(0, 2**32 - 1))
    out = []
    for r in range(size):
        rng = np.random.default_rng([seed, r])
        m = int(rng.integers(0, 30))
        idx = rng.integers(0, min(n, 60), size=m) if draw(st.booleans()) else rng.integers(0, n, m)
        vals = np.rint(rng.standard_normal(m) * 3).astype(dtype)  # zeros and ties included
        out.append(coalesce(idx.astype(index_dtype(n)), vals, n))
    return out


@given(inputs=rank_inputs(), k=st.integers(0, 40))
def test_tree_shape_and_conservation(inputs, k):
    result, masks = gtopk_tree(inputs, k)
    idx = result.indices.astype(np.int64)
    assert result.nnz <= k
    assert np.all(np.diff(idx) > 0)
    assert np.all(result.values != 0)
    # every kept value is exactly the sum of the contributions marked as reaching it
    n = inputs[0].n
    parts = [(x.indices[m], x.values[m]) for x, m in zip(inputs, masks)]
    marked = coalesce(
        np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), n
    )
    keep = marked.values != 0
    assert np.array_equal(marked.indices[keep], result.indices)
    assert np.array_equal(marked.values[keep].astype(np.float64), result.values.astype(np.float64))


@given(inputs=rank_inputs(), k=st.integers(0, 40))
def test_tree_small_cases_by_hand(inputs, k):
    result, masks = gtopk_tree(inputs, k)
    if len(inputs) == 1:  # one rank: its own top-k
        pos = brute_topk(inputs[0].values, k)
        assert result.indices.tolist() == inputs[0].indices[pos].tolist()
        assert np.flatnonzero(masks[0]).tolist() == pos
    if len(inputs) == 2:  # two ranks: top-k of the sum of the two local top-k
        tops = [
            (x.indices[brute_topk(x.values, k)], x.values[brute_topk(x.values, k)]) for x in inputs
        ]
        want = merge_topk(tops[0], tops[1], k, inputs[0].n)
        assert result.indices.tolist() == want[0].tolist()


@given(sizes=st.lists(st.integers(0, 6), min_size=1, max_size=9), seed=st.integers(0, 2**32))
def test_tree_exact_for_disjoint_inputs_within_k(sizes, seed):
    rng = np.random.default_rng(seed)
    n = 10 * len(sizes)
    inputs = []
    for r, m in enumerate(sizes):
        idx = 10 * r + np.sort(rng.choice(10, size=m, replace=False))
        inputs.append(SparseVector(idx.astype(np.int32), rng.uniform(1, 2, m), n))
    k = sum(sizes)
    result, masks = gtopk_tree(inputs, k)
    assert result.indices.tolist() == np.concatenate([x.indices for x in inputs]).tolist()
    assert all(m.all() for m in masks)


def test_dropped_in_subtree_goes_back_even_if_index_survives():
    # 4 ranks, k = 1. Ranks 0,1 merge {5: 1.0} and {7: 2.0}: index 5 is dropped. Ranks 2,3
    # keep {5: 10.0}. Index 5 survives in the end, but rank 0's 1.0 never reached it.
    n = 10
    inputs = [
        SparseVector(np.array([5], np.int32), np.array([1.0]), n),
        SparseVector(np.array([7], np.int32), np.array([2.0]), n),
        SparseVector(np.array([5], np.int32), np.array([10.0]), n),
        SparseVector(np.array([3], np.int32), np.array([0.5]), n),
    ]
    result, masks = gtopk_tree(inputs, 1)
    assert result.indices.tolist() == [5]
    assert result.values.tolist() == [10.0]
    assert [m.tolist() for m in masks] == [[False], [False], [True], [False]]


@st.composite
def sampled_ranks(draw):
    size = draw(st.integers(1, 16))
    n = draw(st.sampled_from([10_000, 10**6, 2**40]))
    kind = draw(st.sampled_from(["skewed", "disjoint", "same", "uneven"]))
    seed = draw(st.integers(0, 2**32))
    rows, every = [], []
    for r in range(size):
        rng = np.random.default_rng([seed, r])
        m = 3000 if kind != "uneven" else int(rng.integers(0, 6000))
        if kind == "skewed":
            idx = np.concatenate(
                [rng.integers(0, n // 10, int(0.9 * m)), rng.integers(0, n, m - int(0.9 * m))]
            )
        elif kind == "disjoint":
            idx = rng.integers(r * n // size, (r + 1) * n // size, m)
        elif kind == "same":
            idx = np.random.default_rng(seed).integers(0, n, m)
        else:
            idx = rng.integers(0, n, m)
        idx = np.unique(idx)
        rows.append(index_samples(idx, sample_segments(size)))
        every.append(idx)
    return n, size, kind, np.array(rows), np.sort(np.concatenate(every))


@given(sampled=sampled_ranks())
def test_boundaries_balance_counts(sampled):
    n, size, kind, rows, every = sampled
    bounds = balanced_boundaries(rows, n, size)
    assert bounds.dtype == np.int64
    assert bounds[0] == 0
    assert bounds[-1] == n
    assert np.all(np.diff(bounds) >= 0)
    counts = np.diff(np.searchsorted(every, bounds))
    total = every.shape[0]
    mean = total / size
    # Each boundary is off its target by at most one segment per rank plus rounding (at most
    # one entry per rank at the boundary index): the bound sample_segments documents.
    per_boundary = total / sample_segments(size) + 2 * size
    assert np.all(np.abs(counts - mean) <= 2 * per_boundary), counts
    if kind != "skewed":  # smooth densities (no cliff inside a rank's range): within 10%
        assert np.all(np.abs(counts - mean) <= 0.1 * mean + 2 * size), counts


def test_boundaries_empty_and_tiny():
    assert balanced_boundaries(np.zeros((3, 6), np.int64), 100, 3).tolist() == [0, 33, 66, 100]
    one = index_samples(np.array([2**40 - 1]), 4)
    assert one.tolist() == [1, 2**40 - 1, 2**40 - 1, 2**40 - 1, 2**40 - 1, 2**40]
    bounds = balanced_boundaries(np.array([one, one]), 2**40, 2)
    assert bounds[0] == 0
    assert bounds[-1] == 2**40
    assert 0 <= bounds[1] <= 2**40
    assert range_bounds(10, 1).tolist() == balanced_boundaries(np.array([one]), 10, 1).tolist()


@pytest.mark.parametrize("width", [400, 3000])
def test_boundaries_balance_indices_near_the_top_of_int64(width):
    """Indices in a narrow range just below 2**63: float64 positions there are 1024 apart
    (and the top ones round to 2**63.0, which has no int64: the cast gave INT64_MIN and
    every region but the last came out empty); offsets from the lowest sample keep them."""
    n, size = 2**63 - 1, 4
    idxs = [
        np.unique(n - 1 - np.random.default_rng([width, r]).integers(0, width, 200))
        for r in range(size)
    ]
    rows = np.array([index_samples(i, sample_segments(size)) for i in idxs])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "invalid value encountered in cast"
        bounds = balanced_boundaries(rows, n, size)
    assert bounds[0] == 0 and bounds[-1] == n and np.all(np.diff(bounds) >= 0)
    every = np.sort(np.concatenate(idxs))
    counts = np.diff(np.searchsorted(every, bounds))
    mean = every.shape[0] / size
    assert np.all(np.abs(counts - mean) <= 0.1 * mean + 2 * size), counts
