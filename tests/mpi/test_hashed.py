"""hashed: bytes per phase against its formula, both run forms, and balance on skewed inputs."""

from __future__ import annotations

import numpy as np
import pytest

import sparsecoll
from sparsecoll._array import index_dtype
from sparsecoll.algorithms._stripes import Stripes
from sparsecoll.algorithms.base import allclose_sparse, reference_sum
from sparsecoll.algorithms.dsa import bruck_counts
from sparsecoll.algorithms.hashed import BLOCK_SHIFT, _Plan
from sparsecoll.sparse import coalesce

from .cases import assert_all, assert_identical


def draw(kind: str, rank: int, n: int, k: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique (indices, values) of ``rank``; every rank can rebuild every other's."""
    rng = np.random.default_rng([17, rank])
    if kind == "hot":  # 90% of the entries in the first 10% of [0, n)
        hot = max(n // 10, 1)
        idx = np.concatenate([rng.integers(0, hot, int(0.9 * k)), rng.integers(0, n, k // 10)])
    elif kind == "zipf":  # index i drawn with probability ∝ 1/(i+1)^1.1
        idx = np.minimum(rng.zipf(1.1, 4 * k) - 1, n - 1)
    elif kind == "rows":  # Zipf-distributed rows of an embedding of 64 columns
        rows = np.minimum(rng.zipf(1.2, k // 64 * 4) - 1, n // 64 - 1)
        idx = (rows[:, None] * 64 + np.arange(64)).ravel()
    elif kind == "same":
        idx = np.random.default_rng(18).integers(0, n, k)
    elif kind == "disjoint":
        idx = rng.integers(0, n, k) // 8 * 8 + rank % 8  # (residues differ up to P = 8)
    else:
        idx = rng.integers(0, n, k)
    idx = np.unique(idx).astype(index_dtype(n))
    return idx, rng.standard_normal(idx.shape[0]).astype(dtype)


def expected(every, P: int, r: int, n: int, dtype, seed: int = 0) -> dict:
    """Bytes rank r sends and receives in each phase, and each run's form (the docstring's)."""
    plan = _Plan(Stripes(n, P, BLOCK_SHIFT, seed), dtype)

    def per_owner(idx):
        owner, _ = plan.stripes.locate(idx)
        return np.bincount(owner, minlength=P)

    c = np.array([per_owner(idx) for idx, _ in every])  # c[s, j]: rank s's entries for j
    K = per_owner(np.unique(np.concatenate([idx for idx, _ in every])))
    block = [plan.run_bytes(int(K[j])) for j in range(P)]
    pull_sent = sum(
        sum(block[(r + b) % P] for b in range(cnt)) for cnt in bruck_counts(P)
    )  # (round i sends the runs held first: r, r+1, ...)

    def bitmap(m, j):
        return m and (plan.length + 7) // 8 < m * plan.otype.itemsize

    return dict(
        push_sent=sum(plan.run_bytes(int(c[r, j])) for j in range(P) if j != r),
        push_recv=sum(plan.run_bytes(int(c[s, r])) for s in range(P) if s != r),
        pull_sent=pull_sent,
        pull_recv=sum(block) - block[r],
        push_forms={bool(bitmap(int(c[s, j]), j)) for s in range(P) for j in range(P) if c[s, j]},
        pull_forms={bool(bitmap(int(K[j]), j)) for j in range(P) if K[j]},
    )


def run(comm, kind: str, n: int, k: int, dtype=np.float32, seed: int = 0):
    """Reduce the drawn inputs; check the sum and that every rank has the same bits."""
    every = [draw(kind, s, n, k, dtype) for s in range(comm.size)]
    idx, vals = every[comm.rank]
    algo = sparsecoll.get_algorithm("hashed", seed=seed)
    out = sparsecoll.allreduce(comm, vals, idx, n=n, algorithm=algo)
    inputs = [coalesce(i, v, n) for i, v in every]
    ok = allclose_sparse(out, reference_sum(inputs), inputs)
    assert_all(comm, ok, f"{kind} n={n}: not the sum")
    assert_identical(comm, out)
    return every, out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    ("kind", "n", "k"),
    [
        ("uniform", 100_003, 200),  # COO both ways
        ("same", 100_003, 3000),
        ("disjoint", 100_003, 2500),  # push COO, pull bitmap (P ≥ 2)
        ("uniform", 20_000, 8000),  # bitmap both ways, owners sum densely
        ("hot", 2**31 - 2, 2000),
        ("uniform", 2**31 + 10, 2000),
        ("zipf", 2**40, 4000),
    ],
)
def test_bytes_match_formula(comm, kind, n, k, dtype):
    P, r = comm.size, comm.rank
    every, out = run(comm, kind, n, k, dtype)
    if P == 1:
        st = out.info["stats"]
        assert_all(comm, st.bytes_sent == 0 and st.bytes_recv == 0)
        return
    want = expected(every, P, r, n, dtype)
    push, pull = out.info["phases"]["push"], out.info["phases"]["pull"]
    got = dict(
        push_sent=push.bytes_sent,
        push_recv=push.bytes_recv,
        pull_sent=pull.bytes_sent,
        pull_recv=pull.bytes_recv,
    )
    for key, value in got.items():
        assert_all(comm, value == want[key], f"{kind} {key}: {value} != {want[key]}")
    forms = {"push": want["push_forms"], "pull": want["pull_forms"]}
    if kind == "uniform" and n == 100_003:
        assert_all(comm, forms == {"push": {False}, "pull": {False}}, f"COO only: {forms}")
    if kind == "uniform" and n == 20_000:
        assert_all(comm, forms == {"push": {True}, "pull": {True}}, f"bitmaps only: {forms}")
    if kind == "disjoint":
        assert_all(comm, forms == {"push": {False}, "pull": {True}}, f"COO, bitmap: {forms}")


@pytest.mark.parametrize("kind", ["hot", "zipf", "rows"])
def test_owners_receive_balanced_bytes_on_skewed_inputs(comm, kind):
    """The most bytes any owner receives in the push is within 1.25x the mean, where dsa's
    ranges (the hot region in one of them) are far apart."""
    P, n, k = comm.size, 2**22, 40_000
    if P == 1:
        return
    _, out = run(comm, kind, n, k)
    got = comm.allgather_ints(out.info["phases"]["push"].bytes_recv)
    idx, vals = draw(kind, comm.rank, n, k, np.float32)
    dsa = sparsecoll.allreduce(comm, vals, idx, n=n, algorithm="dsa")
    ref = comm.allgather_ints(dsa.info["phases"]["reduce_scatter"].bytes_recv)
    ratio = max(got) / (sum(got) / P)
    assert_all(comm, ratio <= 1.25, f"{kind}: max/mean {ratio:.3f} ({list(got)})")
    if kind == "hot":  # (the inputs are skewed: range-split owners are not balanced)
        dsa_ratio = max(ref) / (sum(ref) / P)
        assert_all(comm, dsa_ratio > 1.5, f"dsa's max/mean {dsa_ratio:.3f}")


@pytest.mark.parametrize("seed", [1, 2**40 + 3])
def test_another_seed_is_exact_too(comm, seed):
    run(comm, "hot", 1_000_003, 5000, np.float64, seed=seed)


def test_ranks_with_different_seeds_are_refused(comm):
    """The seed is in the signature: ranks that disagree raise, none hangs."""
    n = 1000
    idx, vals = draw("uniform", comm.rank, n, 100, np.float32)
    algo = sparsecoll.get_algorithm("hashed", seed=comm.rank % 2)
    if comm.size == 1:
        return
    with pytest.raises(sparsecoll.CollectiveInputError, match="rank 1 differs from rank 0"):
        sparsecoll.allreduce(comm, vals, idx, n=n, algorithm=algo)
