"""Bytes per rank of dsa, ring and recursive_doubling against their formulas (ALGORITHMS.md and the
module docstrings), and auto's choice being the same documented rule on every rank."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import sparsecoll
from sparsecoll._array import index_dtype
from sparsecoll.algorithms import ring
from sparsecoll.algorithms.auto import Auto, choose
from sparsecoll.algorithms.base import Fold, range_bounds, sparse_is_cheaper
from sparsecoll.algorithms.dsa import bruck_counts, chunk_bytes
from sparsecoll.benchmarks.problems import make_problem
from sparsecoll.sparse import coalesce

from .cases import assert_all, assert_identical

HUGE = 2**31 + 10  # int64 indices


def problem(kind: str, rank: int, P: int, n: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique (indices, values) of ``rank``; every rank can rebuild every other's."""
    if kind == "one_dense":  # rank 0 dense over all of [0, n), the others sparse
        if rank == 0:
            idx = np.arange(n)
            vals = np.random.default_rng([3, rank]).standard_normal(n).astype(dtype)
            return idx.astype(index_dtype(n)), vals
        kind = "random"
    if kind == "pool":  # k of a shared pool of 2k indices: partial overlap
        pool = np.random.default_rng(11).choice(n, size=400, replace=False)
        rng = np.random.default_rng([12, rank])
        idx = np.sort(rng.choice(pool, size=200, replace=False))
        return idx.astype(index_dtype(n)), rng.standard_normal(200).astype(dtype)
    density = {"random": 0.002, "same": 0.01, "disjoint": 0.1, "dense": 0.3}[kind]
    if n > 2**24:
        density = 500 / n
    overlap = "random" if kind == "dense" else kind
    vals, idx = make_problem(n, density, rank, P, overlap, dtype, seed=5)
    return idx, vals


def inputs(kind: str, P: int, n: int, dtype) -> list[tuple[np.ndarray, np.ndarray]]:
    return [problem(kind, r, P, n, dtype) for r in range(P)]


def dsa_expected(every, P: int, r: int, n: int, dtype, width=None) -> dict[str, int]:
    itype = index_dtype(n)
    bounds = range_bounds(n, P)
    lengths = np.diff(bounds)
    cuts = [np.searchsorted(idx, bounds) for idx, _ in every]
    c = np.array([np.diff(cut) for cut in cuts])  # c[s, j]: rank s's nonzeros in range j

    def cb(nnz, j):
        return chunk_bytes(int(nnz), int(lengths[j]), itype, dtype, width)

    rs_sent = sum(cb(c[r, j], j) for j in range(P) if j != r)
    rs_recv = sum(cb(c[s, r], r) for s in range(P) if s != r)
    union = np.unique(np.concatenate([idx for idx, _ in every]))
    K = np.diff(np.searchsorted(union, bounds))  # reduced nnz per range (no cancellation)
    block = [cb(K[j], j) for j in range(P)]
    ag_sent = 0
    for cnt in bruck_counts(P):  # each round sends the first cnt blocks held: r, r+1, ...
        ag_sent += sum(block[(r + b) % P] for b in range(cnt))
    ag_recv = sum(block) - block[r]
    dense_chunks = sum(
        not sparse_is_cheaper(int(c[r, j]), int(lengths[j]), itype, dtype, width)
        for j in range(P)
        if j != r and c[r, j]
    )
    dense_ranges = sum(
        not sparse_is_cheaper(int(K[j]), int(lengths[j]), itype, dtype, width) for j in range(P)
    )
    return dict(
        rs_sent=rs_sent,
        rs_recv=rs_recv,
        ag_sent=ag_sent,
        ag_recv=ag_recv,
        dense_chunks=dense_chunks,
        dense_ranges=dense_ranges,
    )


def _run(comm, name, idx, vals, n, algorithm=None):
    return sparsecoll.allreduce(comm, vals, idx, n=n, algorithm=algorithm or name)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    ("kind", "n"),
    [
        ("random", 100_003),
        ("same", 100_003),
        ("disjoint", 100_003),
        ("one_dense", 4099),
        ("dense", 20_000),
        ("random", HUGE),
        ("same", HUGE),
    ],
)
def test_dsa_bytes_match_formula(comm, kind, n, dtype):
    P, r = comm.size, comm.rank
    every = inputs(kind, P, n, dtype)
    out = _run(comm, "dsa", *every[r], n)
    want = dsa_expected(every, P, r, n, dtype)
    st = out.info["stats"]
    if P == 1:
        assert_all(comm, st.bytes_sent == 0 and st.bytes_recv == 0)
        return
    rs, ag = out.info["phases"]["reduce_scatter"], out.info["phases"]["allgather"]
    got = dict(
        rs_sent=rs.bytes_sent, rs_recv=rs.bytes_recv, ag_sent=ag.bytes_sent, ag_recv=ag.bytes_recv
    )
    for key, value in got.items():
        assert_all(comm, value == want[key], f"{kind} {key}: {value} != {want[key]}")
    assert_all(comm, st.bytes_sent == rs.bytes_sent + ag.bytes_sent)
    # the dense switch is exercised where the inputs call for it
    if kind == "one_dense":
        assert_all(comm, r != 0 or want["dense_chunks"] == P - 1, "rank 0 sends dense chunks")
        assert_all(comm, want["dense_ranges"] == P, "every range travels dense")
    if kind == "disjoint" and dtype == np.float32 and P >= 5:  # 0.1·n ≥ half a range
        assert_all(comm, want["dense_ranges"] >= 1, "some ranges travel dense")
    if kind in ("random", "same") and n == HUGE:
        assert_all(comm, want["dense_ranges"] == 0)
    assert_identical(comm, out)


def test_dsa_reduce_scatter_sends_about_k_p_minus_1_over_p(comm):
    """Uniform random indices at density ≪ 1/P: ≈ k(P−1)/P pairs in the reduce-scatter."""
    P, n, k = comm.size, 2**20, 2000
    rng = np.random.default_rng([21, comm.rank])
    idx = np.sort(rng.choice(n, size=k, replace=False)).astype(np.int32)
    out = _run(comm, "dsa", idx, rng.standard_normal(k).astype(np.float32), n)
    if P == 1:
        return
    pairs = out.info["phases"]["reduce_scatter"].bytes_sent / 8
    expect = k * (P - 1) / P
    assert_all(comm, abs(pairs - expect) <= 0.1 * expect, f"{pairs} pairs, expected ≈ {expect}")


@pytest.mark.parametrize("kind", ["same", "pool"])
def test_dsa_sends_less_than_allgather_with_overlap(comm, kind):
    P, n = comm.size, 100_003
    idx, vals = problem(kind, comm.rank, P, n, np.float32)
    d = _run(comm, "dsa", idx, vals, n).info["stats"].bytes_sent
    a = _run(comm, "allgather", idx, vals, n).info["stats"].bytes_sent
    if P >= 4:
        assert_all(comm, d < a, f"dsa sent {d}, allgather {a}")
    if kind == "same" and P > 1:
        # k(P−1)/P in each phase: identical indices, no build-up
        k = idx.shape[0]
        pairs = d / 8
        assert_all(comm, abs(pairs - 2 * k * (P - 1) / P) <= 0.1 * k, f"{pairs} pairs")


def ring_expected(every, P: int, r: int, n: int, dtype) -> dict[str, int]:
    """Bytes rank r moves in the ring: at step s it sends the union of ranks r, r−1, …, r−s
    in each block of segment r − s (and receives the same of r − 1's), then it forwards the
    reduced segments r + 1 − s and receives r − s, s = 0 … P − 2."""
    itype = index_dtype(n)
    C = ring.ring_blocks(n, P)
    bounds = range_bounds(n, P * C)
    cuts = [np.searchsorted(idx, bounds) for idx, _ in every]

    def block(q, b):
        return every[q][0][cuts[q][b] : cuts[q][b + 1]]

    def sent_by(q, s, ranks):  # the running sum of segment q − s, over ``ranks``
        j = (q - s) % P
        total = 0
        for b in range(j * C, (j + 1) * C):
            union = np.unique(np.concatenate([block(t % P, b) for t in ranks]))
            total += chunk_bytes(int(union.shape[0]), int(bounds[b + 1] - bounds[b]), itype, dtype)
        return total

    def segment(j):  # the reduced segment j (no sum cancels in these inputs)
        return sent_by(j, 0, range(P))

    return dict(
        rs_sent=sum(sent_by(r, s, range(r - s, r + 1)) for s in range(P - 1)),
        rs_recv=sum(sent_by(r - 1, s, range(r - 1 - s, r)) for s in range(P - 1)),
        ag_sent=sum(segment((r + 1 - s) % P) for s in range(P - 1)),
        ag_recv=sum(segment((r - s) % P) for s in range(P - 1)),
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    ("kind", "n"),
    [
        ("random", 100_003),
        ("same", 100_003),
        ("disjoint", 100_003),
        ("one_dense", 4099),
        ("dense", 20_000),
        ("dense", 7),
        ("same", HUGE),
    ],
)
@pytest.mark.parametrize("blocks", [None, 3])
def test_ring_bytes_match_formula(comm, monkeypatch, kind, n, dtype, blocks):
    """(``blocks``: segments cut into that many messages; None: ring's own rule.)"""
    if blocks is not None:
        monkeypatch.setattr(ring, "ring_blocks", lambda n, size: blocks)
    P, r = comm.size, comm.rank
    every = inputs(kind, P, n, dtype)
    out = _run(comm, "ring", *every[r], n)
    st = out.info["stats"]
    if P == 1:
        assert_all(comm, st.bytes_sent == 0 and st.bytes_recv == 0)
        return
    want = ring_expected(every, P, r, n, dtype)
    rs, ag = out.info["phases"]["reduce_scatter"], out.info["phases"]["allgather"]
    got = dict(
        rs_sent=rs.bytes_sent, rs_recv=rs.bytes_recv, ag_sent=ag.bytes_sent, ag_recv=ag.bytes_recv
    )
    for key, value in got.items():
        assert_all(comm, value == want[key], f"{kind} {key}: {value} != {want[key]}")
    assert_all(comm, st.bytes_sent == rs.bytes_sent + ag.bytes_sent)
    if kind == "same":  # k(P−1)/P pairs in each phase: identical indices, no build-up
        k = every[r][0].shape[0]
        pair = index_dtype(n).itemsize + np.dtype(dtype).itemsize
        assert_all(comm, abs(st.bytes_sent / pair - 2 * k * (P - 1) / P) <= 0.1 * k + 2 * P)
    assert_identical(comm, out)


def rd_expected_sent(every, P: int, r: int, n: int, dtype, width=None) -> int:
    """Bytes rank r sends in recursive doubling: its whole vector every round."""
    itype = index_dtype(n)

    def cost(ranks) -> int:
        union = np.unique(np.concatenate([every[s][0] for s in ranks]))
        return chunk_bytes(int(union.shape[0]), n, itype, dtype, width)

    fold = Fold.plan(r, P)
    if P == 1:
        return 0
    if fold.folded:
        return cost([r])

    def holders(newranks) -> list[int]:  # real ranks whose input a power-of-two rank holds
        out = []
        for v in newranks:
            f = Fold.plan(fold.real_rank(v), P)
            out += [f.rank] + ([f.partner] if f.partner >= 0 else [])
        return out

    sent = 0
    mask = 1
    while mask < fold.pof2:  # entering this round: the block of newranks sharing bits >= mask
        base = fold.newrank & ~(mask - 1)
        sent += cost(holders(range(base, base + mask)))
        mask <<= 1
    group = holders(range(fold.pof2))
    if fold.partner >= 0:
        sent += cost(group)
    return sent


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize(
    ("kind", "n"),
    [
        ("random", 100_003),
        ("same", 100_003),
        ("disjoint", 100_003),
        ("dense", 20_000),
        ("one_dense", 4099),
        ("same", HUGE),
    ],
)
def test_recursive_doubling_bytes_match_formula(comm, kind, n, dtype):
    P, r = comm.size, comm.rank
    every = inputs(kind, P, n, dtype)
    out = _run(comm, "recursive_doubling", *every[r], n)
    want = rd_expected_sent(every, P, r, n, dtype)
    got = out.info["stats"].bytes_sent
    assert_all(comm, got == want, f"{kind}: sent {got}, expected {want}")
    if kind == "same" and P & (P - 1) == 0:  # k·log2 P pairs, no build-up
        k = every[r][0].shape[0]
        pair = index_dtype(n).itemsize + np.dtype(dtype).itemsize
        assert_all(comm, got == k * pair * int(math.log2(P)))
    assert_identical(comm, out)


def as_rows(every, width: int):
    """Each input's values as rows of ``width`` (a nonzero row for every nonzero value)."""
    return [(idx, vals[:, None] * np.arange(1, width + 1, dtype=vals.dtype)) for idx, vals in every]


@pytest.mark.parametrize("width", [3, 16])
@pytest.mark.parametrize(
    ("kind", "n"), [("random", 100_003), ("same", 4099), ("dense", 20_000), ("one_dense", 4099)]
)
def test_rows_bytes_match_formula(comm, kind, n, width):
    """Rows: the formulas of dsa and recursive_doubling with an index and D values a pair, and
    a dense range of length·D values; auto's choice the rule's with D."""
    P, r, dtype = comm.size, comm.rank, np.float32
    every = as_rows(inputs(kind, P, n, dtype), width)
    out = _run(comm, "dsa", *every[r], n)
    if P > 1:
        want = dsa_expected(every, P, r, n, dtype, width)
        rs, ag = out.info["phases"]["reduce_scatter"], out.info["phases"]["allgather"]
        got = dict(rs_sent=rs.bytes_sent, rs_recv=rs.bytes_recv, ag_sent=ag.bytes_sent)
        got["ag_recv"] = ag.bytes_recv
        for key, value in got.items():
            assert_all(comm, value == want[key], f"dsa {kind} {key}: {value} != {want[key]}")
    assert_identical(comm, out)
    out = _run(comm, "recursive_doubling", *every[r], n)
    want_rd = rd_expected_sent(every, P, r, n, dtype, width)
    got_rd = out.info["stats"].bytes_sent
    assert_all(comm, got_rd == want_rd, f"rd {kind}: sent {got_rd}, expected {want_rd}")
    total = sum(idx.shape[0] for idx, _ in every)
    auto = Auto()
    out = sparsecoll.allreduce(comm, every[r][1], every[r][0], n=n, algorithm=auto)
    why = out.info["auto"]
    model = dataclasses.replace(auto.model, alpha=why["alpha"], beta=why["beta"])
    rule = choose(P, n, total, np.int32, dtype, None, model, width=width)
    assert_all(comm, out.info["auto_choice"] == rule, f"auto chose {out.info['auto_choice']}")


@pytest.mark.parametrize("kind", ["same", "disjoint", "random"])
def test_auto_choice_follows_rule_and_learns_overlap(comm, kind):
    P, n = comm.size, 100_003
    idx, vals = problem(kind, comm.rank, P, n, np.float32)
    auto = Auto(tries=1)  # (the model's pick alone: no measured contenders)
    every = [problem(kind, s, P, n, np.float32)[0] for s in range(P)]
    total = sum(i.shape[0] for i in every)
    bounds = range_bounds(n, P)
    loads = sum(np.diff(np.searchsorted(i, bounds)) for i in every).tolist()
    for call in range(2):
        theta = auto.theta
        out = sparsecoll.allreduce(comm, vals, idx, n=n, algorithm=auto)
        got = out.info["auto_choice"]
        # (the seconds per byte it predicted with: the constant, or learned from calls)
        model = dataclasses.replace(
            auto.model, alpha=out.info["auto"]["alpha"], beta=out.info["auto"]["beta"]
        )
        want = choose(P, n, total, np.int32, np.float32, theta, model, loads)
        choices = comm.allgather_object(got)
        assert_all(comm, all(c == got for c in choices), f"choices differ: {choices}")
        assert_all(comm, got == want, f"call {call}: chose {got}, rule says {want}")
        assert_all(comm, out.info["auto_nnz_total"] == total)
        if P > 1:
            why = out.info["auto"]
            assert_all(comm, why["choice"] == got and why["nnz"] == total and why["loads"] == loads)
            assert_all(comm, min(why["predicted"], key=why["predicted"].get) == got)
        assert_identical(comm, out)
    if P > 1:
        kbar = total / P
        theta = math.log(out.nnz / kbar) / math.log(P)
        assert_all(comm, abs(auto.theta - min(1.0, max(0.0, theta))) < 1e-12)
        if kind == "same":
            assert_all(comm, auto.theta == 0.0, f"theta {auto.theta}")
        if kind == "disjoint":
            assert_all(comm, abs(auto.theta - 1.0) < 1e-3, f"theta {auto.theta}")


@pytest.mark.parametrize("kind", ["random", "skewed"])
def test_auto_measures_its_contenders_then_runs_the_fastest(comm, kind):
    """The first calls run each contender (the cheapest predictions) in a run of calls whose
    first is no sample, later ones the fastest measured (median): every call's pick is
    that rule's on the samples in its info, the samples are the same on every rank, and
    every result is the exact sum."""
    from sparsecoll.algorithms._tune import SAMPLES

    if comm.size == 1:
        return
    P, n = comm.size, 100_003
    vals, idx = make_problem(n, 0.01, comm.rank, P, kind)
    want = sparsecoll.allreduce(comm, vals, idx, n=n, algorithm="dense").to_dense()
    auto = Auto(alpha=5e-6, beta=1e-9, tries=3, spread=100.0)
    picks = []
    for call in range(3 * (SAMPLES + 1) + 3):
        out = sparsecoll.allreduce(comm, vals, idx, n=n, algorithm=auto)
        why, pick = out.info["auto"], out.info["auto_choice"]
        contenders, kept = why["contenders"], why["measured"]
        pending = [c for c in contenders if len(kept.get(c, [])) < SAMPLES]
        before = picks[-1] if picks else None
        if pending:
            rule = before if before in pending else pending[0]
        else:
            rule = min(contenders, key=lambda c: float(np.median(kept[c])))
        picks.append(pick)
        assert_all(comm, pick == rule, f"call {call}: {pick}, rule {rule} ({why})")
        assert_all(comm, len(contenders) == min(3, len(why["predicted"])), f"{contenders}")
        seen = comm.allgather_object((pick, kept))
        assert_all(comm, all(s == seen[0] for s in seen), f"call {call}: ranks differ: {seen}")
        assert_all(comm, np.allclose(out.to_dense(), want, rtol=1e-5, atol=1e-5), f"call {call}")
    assert_all(comm, len(set(picks[: 3 * (SAMPLES + 1)])) == 3, f"not all measured: {picks}")
    auto.reset()
    out = sparsecoll.allreduce(comm, vals, idx, n=n, algorithm=auto)
    assert_all(comm, out.info["auto"]["measured"] == {}, "reset() keeps the samples")


def test_auto_measures_the_link_once_per_communicator(comm):
    """Auto() measures the seconds per message and per byte at its first call on a
    communicator, the same on every rank; later calls on it, by any instance, reuse the
    measure without sending the probe again; Auto(alpha=..., beta=...) predicts with the
    values given."""
    if comm.size == 1:
        return
    from sparsecoll.algorithms._link import PROBE_BYTES

    P, r = comm.size, comm.rank
    vals, idx = np.ones(4, np.float32), np.arange(4) * P + r
    fresh = sparsecoll.Communicator(comm.mpi_comm.Dup())
    try:
        betas = []
        for algo in (Auto(), Auto(), Auto(alpha=3e-5, beta=2.5e-9)):
            with fresh.measure() as stats:
                out = sparsecoll.allreduce(fresh, vals, idx, n=4 * P, algorithm=algo)
            betas.append((out.info["auto"]["alpha"], out.info["auto"]["beta"]))
            probed = stats.bytes_sent >= 2 * PROBE_BYTES
            assert_all(comm, probed == (len(betas) == 1), f"call {len(betas)}: {stats}")
        assert_all(comm, len(set(comm.allgather_object(betas[0]))) == 1, f"{betas}")
        (alpha, beta), again, given = betas
        assert_all(comm, 1e-7 <= alpha <= 1e-2 and 1e-12 <= beta <= 1e-6, f"{betas}")
        assert_all(comm, again == (alpha, beta) and given == (3e-5, 2.5e-9), f"{betas}")
        assert_all(comm, Auto().alpha is None and Auto().beta is None)
    finally:
        fresh.mpi_comm.Free()


def test_auto_statistics_ride_on_the_agreement(comm):
    """Up to P = 8 auto's loads and last time come with the call's input agreement (also
    when calibrating): its call moves the same metadata as its pick called directly; beyond,
    one more allreduce."""
    from sparsecoll._agree import STATS_MAX_P

    P, n = comm.size, 100_003
    idx, vals = problem("random", comm.rank, P, n, np.float32)
    for calibrate in (False, True):
        auto = Auto(beta=1e-9, calibrate=calibrate)
        out = sparsecoll.allreduce(comm, vals, idx, n=n, algorithm=auto)
        pick = out.info["auto_choice"]
        base, _, wire = pick.partition(":")
        direct = sparsecoll.allreduce(
            comm, vals, idx, n=n, algorithm=base, **({"wire": wire} if wire else {})
        )
        extra = out.info["stats"].meta_messages_sent - direct.info["stats"].meta_messages_sent
        rides = 1 < P <= STATS_MAX_P
        assert_all(comm, (extra == 0) == (rides or P == 1), f"calibrate={calibrate}: {extra}")
        assert_all(comm, out.info["auto"]["nnz"] == comm.allreduce_ints([idx.size])[0])


@pytest.mark.parametrize("through", ["allreduce", "reduce"])
def test_auto_takes_the_slowest_ranks_time(comm, through):
    """A sample is the slowest rank's seconds in the pick, by the call's agreement or (a
    reduce called directly) the two allreduces of its own: each rank's time set to
    (rank + 1) ms, the samples are P ms."""
    from sparsecoll.algorithms.auto import _tuner
    from sparsecoll.sparse import coalesce

    P, n = comm.size, 100_003
    if P == 1:
        return
    idx, vals = problem("random", comm.rank, P, n, np.float32)
    auto = Auto(beta=1e-9, tries=1)  # (the model's pick: from the second call on, one)
    for _ in range(8):
        if through == "allreduce":
            out = sparsecoll.allreduce(comm, vals, idx, n=n, algorithm=auto)
        else:
            out = auto.reduce(comm, coalesce(idx, vals, n))
        _tuner(auto).elapsed = (comm.rank + 1) * 1e-3
    kept = out.info["auto"]["measured"][out.info["auto_choice"]]
    assert_all(comm, len(kept) >= 1 and kept[-1] == P * 1e-3, f"{kept}")


def test_auto_state_mismatch_raises_everywhere(comm):
    """Ranks whose auto instances learned different overlaps fail together, before any
    payload, saying to call reset() on every rank; after it the call goes on (auto had no
    reset(), which the message and GradientReducer.reset() count on)."""
    if comm.size == 1:
        return
    auto = Auto()
    auto.theta = 0.5 if comm.rank == comm.size - 1 else None
    vals = np.ones(3, np.float32)
    idx = np.arange(3)
    with pytest.raises(
        ValueError,
        match=r"algorithm options \(and the state of earlier calls\) must be the same on "
        rf"every rank: rank {comm.size - 1} differs from rank 0 \(.*call its reset\(\)",
    ):
        sparsecoll.allreduce(comm, vals, idx, n=10, algorithm=auto)
    auto.reset()
    out = sparsecoll.allreduce(comm, vals, idx, n=10, algorithm=auto)
    assert_all(comm, out.indices.tolist() == [0, 1, 2] and auto.theta == 0.0, f"{out}")


@pytest.mark.parametrize("name", ["dsa", "recursive_doubling", "ring"])
def test_result_does_not_alias_input(comm, name):
    n = 50
    idx = np.arange(0, n, 2, dtype=np.int32)
    vals = np.ones(idx.shape[0], np.float32)
    x = coalesce(idx, vals, n)
    out = sparsecoll.allreduce(comm, x.values, x.indices, n=n, algorithm=name)
    out.values[:] = -7
    assert_all(comm, bool(np.all(vals == 1)), "result shares memory with the input")
