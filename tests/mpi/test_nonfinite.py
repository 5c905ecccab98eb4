"""Infinities in the input: +inf and -inf from different ranks meet at an index, where the
dense sum is NaN (IEEE, as MPI_SUM gives). NaN *inputs* are refused by the selecting
algorithms (tests/mpi/test_errors.py); a NaN made inside the reduction must neither stop it
on some ranks (a hang: gtopk's merge once raised on the merging pair only) nor be dropped.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import sparsecoll
from sparsecoll import SparseVector
from sparsecoll._array import index_dtype
from sparsecoll.algorithms.gtopk import gtopk_tree
from sparsecoll.registry import algorithm_class

from .cases import assert_all, assert_identical

ALGORITHMS = sparsecoll.available_algorithms()


def rank_input(seed: int, n: int, dtype: str, hot: int, rank: int, size: int) -> SparseVector:
    """Small nonzero integers (exact sums in every dtype) at random indices, and an
    infinity at each of the ``hot`` lowest indices: its sign drawn per (index, rank), and
    at index 0 alternating with the rank, so that both signs meet there when P > 1."""
    rng = np.random.default_rng([seed, rank])
    idx = np.unique(np.concatenate([np.arange(hot), rng.integers(hot, n, size=n // 8 + 1)]))
    vals = rng.integers(1, 9, size=idx.shape[0]) * rng.choice([-1, 1], size=idx.shape[0])
    vals = vals.astype(dtype)
    signs = np.random.default_rng([seed, rank, 1]).choice([-1, 1], size=hot)
    signs[0] = 1 if rank % 2 else -1
    vals[:hot] = signs * np.inf
    return SparseVector(idx.astype(index_dtype(n)), vals, n)


def dense_sum(inputs: list[SparseVector], n: int) -> np.ndarray:
    total = np.zeros(n, np.float64)
    with np.errstate(invalid="ignore"):
        for x in inputs:
            total[x.indices.astype(np.int64)] += x.values.astype(np.float64)
    return total


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=True))


def first_difference(idx, got, want) -> str:
    j = np.flatnonzero(~((got == want) | (np.isnan(got) & np.isnan(want))))
    return f"at index {idx[j[0]]}: {got[j[0]]} vs {want[j[0]]}" if j.shape[0] else "order"


@pytest.mark.parametrize("name", ALGORITHMS)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.sampled_from([8, 200, 5000]),
    dtype=st.sampled_from(["float16", "float32", "float64"]),
    hot=st.integers(1, 6),
    k=st.integers(1, 40),
)
def test_infinities_meeting_at_an_index(comm, name, seed, n, dtype, hot, k):
    """Every rank completes with the same result, without a warning: exact algorithms hold
    the dense sum (NaN where +inf met -inf, ±inf where only one sign did); gtopk equals its
    sequential tree; oktopk's and exdyna's kept values are the dense sum's."""
    cls = algorithm_class(name)
    inputs = [rank_input(seed, n, dtype, hot, r, comm.size) for r in range(comm.size)]
    x = inputs[comm.rank]
    opts = {} if cls.exact else cls.default_options(n, k)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = sparsecoll.allreduce(comm, x.values, x.indices, n=n, algorithm=name, **opts)
    noise = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert_all(comm, not noise, f"{name} warned: {noise}")
    assert_identical(comm, out)
    got_idx = np.asarray(out.indices).astype(np.int64)
    got = np.asarray(out.values).astype(np.float64)
    total = dense_sum(inputs, n)
    if cls.exact:  # (a sum that cancels to 0 may be kept, as an explicit zero)
        dense = np.zeros(n)
        dense[got_idx] = got
        ok = bool(np.all(np.diff(got_idx) > 0)) and same(dense, total)
        why = first_difference(np.arange(n), dense, total)
    elif name == "gtopk":
        want, _ = gtopk_tree(inputs, k)
        ok = same(got_idx, want.indices.astype(np.int64)) and same(
            got, want.values.astype(np.float64)
        )
        why = f"{got_idx} {got} vs tree {want.indices} {want.values}"
    else:
        ok = same(got, total[got_idx])
        why = f"kept {got_idx[:8]} {got[:8]}, sums there {total[got_idx][:8]}"
    if comm.size > 1 and (cls.exact or name == "gtopk"):  # (gtopk: index 0 ranks first)
        ok = ok and 0 in got_idx and bool(np.isnan(got[got_idx == 0]).all())
    assert_all(comm, ok, f"{name}: {why}")


@pytest.mark.parametrize(
    ("name", "opts"), [("oktopk", {"rule": "paper", "tau": 1000}), ("exdyna", {"rule": "authors"})]
)
def test_a_threshold_nudged_past_the_largest_float_comes_back(comm, name, opts):
    """Too many kept at float64's largest value nudges a reused threshold up: it once
    became inf, which keeps nothing, and inf / nudge is inf, so every later reuse call kept
    nothing (oktopk's paper rule until its next recompute, exdyna's authors' rule for
    ever), though no sum overflowed (each index on one rank only). Held to the largest
    float, it comes back down once fewer are kept, and later calls keep the values just
    below the top again."""
    n, k, size, top = 4000, 20, comm.size, float(np.finfo(np.float64).max)
    algo = sparsecoll.get_algorithm(name, k=k, **opts)
    idx = np.arange(comm.rank, n, size)  # disjoint: every sum is one rank's value
    rng = np.random.default_rng([11, comm.rank])
    kept, thresholds = [], []
    for call in range(16):
        if call < 3:  # 4k entries in all at the top, the rest far below
            vals = rng.uniform(0.5, 1.0, idx.shape[0]) * 1e-10 * top
            vals[: -(-4 * k // size)] = top
        else:  # every entry within 3% below the top
            vals = rng.uniform(0.97, 0.99, idx.shape[0]) * top
        out = sparsecoll.allreduce(comm.mpi_comm, vals, idx, n=n, algorithm=algo)
        kept.append(out.nnz)
        thresholds.append(float(algo.threshold))
    ok = all(math.isfinite(t) for t in thresholds) and sum(kept[3:]) > 0
    assert_all(comm, ok, f"{name}: kept {kept}, thresholds {thresholds}")


@pytest.mark.parametrize("dtype", ["float16", "float64"])
@pytest.mark.parametrize("name", ["gtopk", "oktopk", "exdyna"])
def test_a_tie_among_infinities_is_cut_to_k(comm, name, dtype):
    """More than k infinities (no two at one index, so no NaN) rank above every number and
    tie: the selecting algorithms keep exactly k of them, as any other tie. exdyna kept
    every one (the window's edges around inf are all inf, so no edge brackets k there and
    no re-derive moves past them): 3·P for k = 2, on a fresh instance and on every call of
    a reused one."""
    n, k = 64, 2
    idx = np.arange(comm.rank, n, comm.size)
    vals = np.arange(1, idx.shape[0] + 1, dtype=np.float64)
    vals[:3] = [np.inf, -np.inf, np.inf]
    vals = vals.astype(dtype)
    algo = sparsecoll.get_algorithm(name, k=k)
    for call in range(4):  # a fresh instance, then one reused
        use, opts = (name, {"k": k}) if call == 0 else (algo, {})
        out = sparsecoll.allreduce(comm.mpi_comm, vals, idx, n=n, algorithm=use, **opts)
        assert_identical(comm, out)
        got = np.asarray(out.values).astype(np.float64)
        ok = out.nnz == k and bool(np.isinf(got).all())
        assert_all(comm, ok, f"{name} call {call}: kept {np.asarray(out.indices)} {got} for k={k}")
