"""The auto rule in-process: predictable choices in clear regimes, the documented formulas."""

from __future__ import annotations

import math
from statistics import median

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import sparsecoll
from sparsecoll.algorithms.auto import (
    CANDIDATES,
    Auto,
    CostModel,
    _tuner,
    choose,
    predict,
    union_size,
)

I32, F32 = np.int32, np.float32


def test_registered_exact_and_not_densifying():
    cls = sparsecoll.registry.algorithm_class("auto")
    assert cls is Auto
    assert cls.exact
    assert not cls.densifies


def test_one_rank_never_communicates():
    assert choose(1, 10**6, 10**5, I32, F32) == "allgather"


def test_tiny_messages_go_to_recursive_doubling():
    # latency-bound: 10 nonzeros per rank
    for P in (2, 4, 8, 64):
        assert choose(P, 2**20, 10 * P, I32, F32) == "recursive_doubling"


def test_moderate_density_goes_to_dsa():
    # 1% per rank of 16M: bandwidth- and merge-bound, independent indices
    for P in (4, 8, 64):
        assert choose(P, 2**24, P * 2**24 // 100, I32, F32) == "dsa"


def test_dense_inputs_go_to_dense():
    for P in (4, 8, 64):
        assert choose(P, 2**20, P * 2**19, I32, F32) == "dense"


def test_dense_never_considered_for_very_sparse_huge_n():
    n = 2**40
    cost = predict(8, n, 8 * 1000, np.int64, F32)
    assert "dense" not in cost
    assert choose(8, n, 8 * 1000, np.int64, F32) != "dense"


def test_identical_indices_favour_recursive_doubling_over_dsa_at_small_p():
    # theta = 0 (no build-up): recursive doubling moves k pairs per round in log2 P rounds
    c = predict(4, 2**20, 4 * 10_000, I32, F32, theta=0.0)
    assert c["recursive_doubling"] < c["allgather"]


def test_formulas_for_allgather_and_dense():
    m = CostModel(alpha=1.0, beta=0.0, gamma_merge=0.0, delta=0.0)
    c = predict(8, 1000, 4000, I32, F32, model=m)
    assert c["allgather"] == 2 * 3  # 2 collectives of lg = 3 messages each (counts, pairs)
    assert c["dense"] == 2 * 3
    assert c["recursive_doubling"] == 2 * 3
    assert c["dsa"] == 3 * 7 + 3 + (2 + 4 + 4)  # Bruck rounds of 1, 2, 4 ranges
    m = CostModel(alpha=0.0, beta=1.0, gamma_merge=0.0, delta=0.0)
    c = predict(8, 1000, 4000, I32, F32, model=m)
    assert c["allgather"] == pytest.approx(7 / 8 * 4000 * 8)
    assert c["dense"] == pytest.approx(2 * 7 / 8 * 1000 * 4)


@pytest.mark.parametrize("P", range(1, 17))
def test_message_terms_match_the_volume_model(P):
    """auto's α terms count the messages the benchmark model counts (sparsecoll.benchmarks.
    model, checked against measured counts by tests/mpi/test_model_volume.py) for sparse
    random inputs: before, allgather was charged 3·lg (it makes 2·lg since its pairs travel
    in one allgatherv), recursive_doubling 2·(⌈log2 P⌉ + 2) at P not a power of two (it
    sends 2·⌊log2 P⌋ + 3), and dsa 3(P−1) + 2·lg (it sends 6 at P = 2, 34 at P = 8)."""
    from sparsecoll.benchmarks.model import AUTO_CANDIDATES, FORMULAS, Problem

    m = CostModel(alpha=1.0, beta=0.0, gamma_merge=0.0, delta=0.0)
    n, k = 10**6, 100  # (sparse everywhere: no range of dsa's goes dense)
    c = predict(P, n, k * P, I32, F32, model=m)
    # (dense is a candidate only when n <= 4 N; its messages do not depend on the data)
    c["dense"] = predict(P, 4 * k * P, k * P, I32, F32, model=m)["dense"]
    for name in AUTO_CANDIDATES:
        assert c[name] == FORMULAS[name](P, Problem(n=n, k=k)).messages, name


def test_dsa_allgather_phase_capped_by_break_even():
    # disjoint indices (theta = 1) at high density: the allgather phase costs at most n values
    m = CostModel(alpha=0.0, beta=1.0, gamma_merge=0.0, delta=0.0)
    P, n = 8, 8000
    c = predict(P, n, P * 1000, I32, F32, theta=1.0, model=m)
    rs = (P - 1) * min(1000 / P * 8, n / P * 4)
    assert c["dsa"] == pytest.approx(rs + (P - 1) / P * n * 4)


def test_union_size_limits():
    assert union_size(8, 1000, 10, 0.0) == 10
    assert union_size(8, 1000, 10, 1.0) == 80
    assert union_size(8, 1000, 500, 1.0) == 1000
    assert union_size(1, 1000, 10, None) == pytest.approx(10)
    assert union_size(2, 1000, 10, None) == pytest.approx(1000 * (1 - 0.99**2))
    assert union_size(4, 1000, 1000, None) == 1000
    assert union_size(4, 1000, 0, None) == 0


@given(
    P=st.integers(2, 1024),
    log_n=st.integers(0, 40),
    density=st.floats(0, 1),
    theta=st.one_of(st.none(), st.floats(0, 1)),
    dtype=st.sampled_from([np.float16, np.float32, np.float64]),
)
def test_choice_is_the_cheapest_candidate(P, log_n, density, theta, dtype):
    n = 2**log_n
    nnz = int(P * density * n)
    itype = np.int32 if n <= 2**31 else np.int64
    cost = predict(P, n, nnz, itype, dtype, theta)
    got = choose(P, n, nnz, itype, dtype, theta)
    assert got in CANDIDATES
    assert all(math.isfinite(v) and v >= 0 for v in cost.values())
    assert cost[got] == min(cost.values())
    # the first candidate in CANDIDATES order wins a tie
    assert got == next(c for c in CANDIDATES if c in cost and cost[c] == cost[got])


def test_options_are_checked():
    with pytest.raises(TypeError, match="latency"):
        Auto(latency=1.0)
    with pytest.raises(TypeError, match="takes alpha, beta, .*got latency"):
        sparsecoll.get_algorithm("auto", latency=1.0)
    for bad in (-1.0, float("inf")):
        with pytest.raises(ValueError, match="finite non-negative"):
            Auto(alpha=bad)
    for bad in (True, "1e-6"):  # a wrong type: TypeError, as numpy's
        with pytest.raises(TypeError, match="alpha must be a real number"):
            Auto(alpha=bad)
    assert Auto(alpha=None).alpha is None  # (None: measured at the first call)
    assert Auto(delta=np.float32(1e-9)).model.delta == float(np.float32(1e-9))
    a = Auto(alpha=1e-5, beta=2e-10)
    assert a.model.alpha == 1e-5
    assert a.model.beta == 2e-10
    for bad in (-1, 2.0, True):
        with pytest.raises((TypeError, ValueError), match="tries must be an integer >= 0"):
            Auto(tries=bad)
    for bad in (0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="spread must be a finite number >= 1"):
            Auto(spread=bad)
    assert (Auto(tries=0).tries, Auto(spread=1).spread) == (0, 1.0)


def test_signature_tracks_constants_and_learned_state():
    a, b = Auto(), Auto()
    assert a.signature() == b.signature()
    b.theta = 0.25
    assert a.signature() != b.signature()
    assert Auto(alpha=1e-6).signature() != a.signature()
    assert Auto(tries=2).signature() != a.signature()
    assert Auto(spread=3.0).signature() != a.signature()


# -- the measured refinement (auto's tuner) ------------------------------------------------
ORDER = ("a", "b", "c", "d", "e")
KEY = (100, None, "<i4", "<f4", True)


def _run(tuner, cost, times, calls, nnz=1000, tries=4, spread=2.5):
    """The picks of ``calls`` calls, each taking ``times[pick]`` seconds."""
    picks = []
    for _ in range(calls):  # (as Auto.reduce: settled contenders need no prediction)
        pick = tuner.settled(KEY, nnz) or tuner.pick(cost, ORDER, KEY, nnz, tries, spread)
        picks.append(pick)
        tuner.last = pick
        tuner.record(times[pick])
    return picks


def test_tuner_measures_each_contender_in_a_run_then_keeps_the_fastest():
    from sparsecoll.algorithms._tune import Tuner

    cost = {"a": 1.0, "b": 1.2, "c": 2.0, "d": 3.0, "e": 1.1}
    times = {"a": 5.0, "b": 2.0, "c": 4.0, "d": 0.1, "e": 3.0}
    tuner = Tuner()
    picks = _run(tuner, cost, times, 12)
    # contenders: the 4 cheapest within 2.5x of the cheapest (d is 3x: out), cheapest
    # first, each two calls in a row (the first of a run is no sample; the instance's
    # first run three)
    assert picks == ["a", "a", "a", "e", "e", "b", "b", "c", "c", "b", "b", "b"]
    # benchmarks of the steady state warm up past the measuring
    assert Auto(tries=4).settle_calls == picks.index("c") + 2 == 9
    assert Auto().settle_calls == 11  # (tries=5)
    assert Auto(tries=1).settle_calls == 0 and Auto(tries=2).settle_calls == 5
    assert tuner.kept() == {"a": (5.0,), "e": (3.0,), "b": (2.0, 2.0, 2.0), "c": (4.0,)}
    # one try, or a spread of 1: the model's pick alone
    assert set(_run(Tuner(), cost, times, 6, tries=1)) == {"a"}
    assert set(_run(Tuner(), cost, times, 6, tries=0)) == {"a"}
    assert _run(Tuner(), cost, times, 7, spread=1.15) == ["a", "a", "a", "e", "e", "e", "e"]


def test_tuner_measures_one_of_each_family_before_a_second():
    """A family is a name before ':' (an algorithm, whatever its wire): within the spread,
    the cheapest of each family first, then the rest by prediction; measured cheapest
    first."""
    from sparsecoll.algorithms._tune import Tuner

    order = ("x", "x:c", "y", "y:c", "z", "w:c", "v")
    cost = {"x": 1.0, "x:c": 1.1, "y": 1.2, "y:c": 1.3, "z": 1.5, "w:c": 2.0, "v": 9.0}
    for tries, want in (
        (3, ["x", "y", "z"]),
        (4, ["x", "y", "z", "w:c"]),
        (5, ["x", "x:c", "y", "z", "w:c"]),
        (9, ["x", "x:c", "y", "y:c", "z", "w:c"]),  # (v: past the spread)
    ):
        tuner = Tuner()
        assert tuner.pick(cost, order, KEY, 1000, tries, 2.5) == "x"
        assert tuner.contenders == want, tries


def test_tuner_follows_a_slowing_pick_and_restarts_in_a_new_regime():
    from sparsecoll.algorithms._tune import KEPT, Tuner

    cost = {"a": 1.0, "b": 1.5}
    tuner = Tuner()
    assert _run(tuner, cost, {"a": 1.0, "b": 2.0}, 7) == ["a", "a", "a", "b", "b", "a", "a"]
    assert tuner.kept() == {"a": (1.0, 1.0), "b": (2.0,)}
    # a slows down: once the median of its kept samples passes b's, b runs
    picks = _run(tuner, cost, {"a": 3.0, "b": 2.0}, KEPT + 2)
    assert picks[0] == "a" and picks[-2:] == ["b", "b"], picks
    assert median(tuner.kept()["b"]) == 2.0 and median(tuner.kept()["a"]) == 3.0
    # the global nnz past twice where the samples began: measured again (the run under
    # way first)
    assert _run(tuner, cost, {"a": 1.0, "b": 2.0}, 4, nnz=2001) == ["b", "a", "a", "a"]
    assert tuner.anchor == 2001
    assert _run(tuner, cost, {"a": 1.0, "b": 2.0}, 1, nnz=1001) == ["a"]  # (within 2x)
    tuner.pick(cost, ORDER, (7, *KEY[1:]), 2001, 4, 2.5)  # another n
    assert tuner.kept() == {}
    # a failed call brings no time: record() without a pick adds nothing
    tuner.record(1.0)
    assert tuner.kept() == {}


def test_tuner_keeps_its_pick_until_another_is_faster_by_the_switch_margin():
    from sparsecoll.algorithms._tune import KEPT, SWITCH, Tuner

    cost = {"a": 1.0, "b": 1.5}
    tuner = Tuner()
    assert _run(tuner, cost, {"a": 1.0, "b": 1.2}, 6) == ["a", "a", "a", "b", "b", "a"]
    # a slows to within the margin of b: it stays
    assert set(_run(tuner, cost, {"a": 1.2 * SWITCH * 0.999, "b": 1.2}, 2 * KEPT)) == {"a"}
    # past it: b runs, and stays while a's samples are within the margin of b's
    picks = _run(tuner, cost, {"a": 1.2 * SWITCH * 1.01, "b": 1.2}, KEPT + 4)
    assert picks[-3:] == ["b"] * 3, picks
    assert set(_run(tuner, cost, {"a": 1.0, "b": 1.2 * SWITCH * 1.01 * 0.999}, 6)) == {"b"}
    # the measuring's last contender stays too when within the margin of the fastest
    assert _run(Tuner(), cost, {"a": 1.0, "b": 1.04}, 7) == ["a", "a", "a"] + ["b"] * 4


def test_tuner_time_is_the_lower_median():
    """Two slow outliers in its last 4 samples do not make a pick give way."""
    from sparsecoll.algorithms._tune import Tuner, low_median

    assert low_median([3.0]) == 3.0 and low_median([2.0, 1.0]) == 1.0
    assert low_median([5.0, 1.0, 2.0]) == 2.0 and low_median([9.0, 1.0, 8.0, 2.0]) == 2.0
    tuner = Tuner()
    cost = {"a": 1.0, "b": 1.5}
    _run(tuner, cost, {"a": 1.0, "b": 2.0}, 8)
    assert _run(tuner, cost, {"a": 9.0, "b": 2.0}, 2) == ["a", "a"]  # (4 kept: 1, 1, 9, 9)
    assert _run(tuner, cost, {"a": 9.0, "b": 2.0}, 2) == ["a", "b"]  # (1, 9, 9, 9)


def test_tuner_predicts_again_every_recheck_calls_once_settled():
    """Settled contenders stand RECHECK calls (no prediction); the next call predicts, and
    a contender new in that prediction is measured."""
    from sparsecoll.algorithms._tune import RECHECK, Tuner

    tuner = Tuner()
    times = {"a": 1.0, "b": 2.0, "c": 0.5}
    assert _run(tuner, {"a": 1.0, "b": 1.5}, times, 6) == ["a", "a", "a", "b", "b", "a"]
    assert tuner.contenders == ["a", "b"] and tuner.stand == RECHECK - 1  # (settled on a)
    # c enters the predictions: the standing contenders ignore it until the recheck
    cost = {"a": 1.0, "b": 1.5, "c": 1.2}
    picks = _run(tuner, cost, times, RECHECK + 2)
    assert picks == ["a"] * (RECHECK - 1) + ["c", "c", "c"], picks
    assert tuner.contenders == ["a", "c", "b"] and tuner.stand == RECHECK - 1
    # another regime predicts at once
    tuner.stand = RECHECK
    assert tuner.settled((7, *KEY[1:]), 1000) is None
    assert tuner.settled(KEY, 2001) is None and tuner.settled(KEY, 1000) == "c"


def _run_timed(tuner, cost, seconds, calls, tries=4):
    """The picks of ``calls`` calls, the i-th call of a pick taking ``seconds(pick, i)``."""
    picks = []
    for _ in range(calls):
        pick = tuner.settled(KEY, 1000) or tuner.pick(cost, ORDER, KEY, 1000, tries, 2.5)
        picks.append(pick)
        tuner.last = pick
        tuner.record(seconds(pick, picks.count(pick)))
    return picks


@pytest.mark.parametrize("first", [1.2, 1.3])
def test_a_close_contender_runs_again_when_the_contenders_stand_down(first):
    """A contender whose one sample came out slow, within CLOSE of the fastest, runs again
    at the next prediction (once its run brings a sample) and takes over if faster; one
    past CLOSE does not."""
    from sparsecoll.algorithms._tune import CLOSE, KEPT, RECHECK, Tuner

    assert 1.2 <= CLOSE < 1.3
    tuner = Tuner()
    # b's first run (its 2nd call the sample) slow, every later call of it fast
    picks = _run_timed(tuner, {"a": 1.0, "b": 1.1}, lambda c, i: first if (c, i) == ("b", 2) else
                       (0.8 if c == "b" else 1.0), 5 + RECHECK + 5)  # fmt: skip
    settled = ["a", "a", "a", "b", "b"] + ["a"] * RECHECK
    if first > CLOSE:
        assert picks == settled + ["a"] * 5, picks
        return
    assert picks == settled + ["b"] * 5, picks
    assert tuner.kept()["b"][-3:] == (0.8, 0.8, 0.8) and tuner.medians["b"] == 0.8
    # sampled KEPT times at most: a close contender with its samples is not run again
    tuner.samples["a"] = (1.0,) * KEPT
    tuner.medians["a"] = 1.0
    tuner.stand = 0
    assert tuner.pick({"a": 1.0, "b": 1.1}, ORDER, KEY, 1000, 4, 2.5) == "b"


def test_tuner_digest_is_integers_that_follow_its_state():
    """The signature packs the tuner's digest as int64s: every field an integer, and each
    change of the state it stands for changes it."""
    from sparsecoll.algorithms._tune import Tuner

    tuner = Tuner()
    seen = [tuner.digest()]
    tuner.pick({"a": 1.0, "b": 1.2}, ORDER, KEY, 1000, 4, 2.5)
    seen.append(tuner.digest())
    tuner.last = "a"
    seen.append(tuner.digest())
    tuner.record(1.0)
    seen.append(tuner.digest())
    tuner.pick({"a": 1.0, "b": 1.2}, ORDER, (7, *KEY[1:]), 1000, 4, 2.5)  # another n
    seen.append(tuner.digest())
    assert all(type(v) is int and -(2**63) <= v < 2**63 for d in seen for v in d)
    assert len(set(seen)) == len(seen), seen
    a, b = Auto(), Auto()
    _tuner(a).last = "a"
    assert a.signature() != b.signature()
    _tuner(b).last = "a"
    assert a.signature() == b.signature()
    a.theta = 0.5
    assert a.signature() != b.signature()


@pytest.mark.parametrize("n", [1, 5, 1000, 2**24, 2**31 + 7])
@pytest.mark.parametrize("vtype", ["<f2", "<f4", "<f8"])
@pytest.mark.parametrize("row", [(), (3,)])
def test_preflight_agreement_starts_at_recursive_doublings_switch_point(n, vtype, row):
    """auto agrees on its pick's preflight from the global nnz where it may allocate:
    recursive_doubling's switch point (sparse_is_cheaper's first False), any N for dense,
    none for allgather."""
    from sparsecoll._array import index_dtype
    from sparsecoll.algorithms.auto import _allocating_from
    from sparsecoll.algorithms.base import sparse_is_cheaper

    key = (n, row, index_dtype(n).str, vtype, True)
    for name in ("recursive_doubling", "recursive_doubling:compact"):
        start = _allocating_from(name, key)
        assert start == int(start) and 0 < start <= n + 1
        width = row[0] if row else None
        for N in {int(start) - 1, int(start), int(start) + 1}:
            cheaper = sparse_is_cheaper(N, n, index_dtype(n), np.dtype(vtype), width)
            assert cheaper == (start > N), (name, N, start)
    assert _allocating_from("dense", key) == 0.0
    assert _allocating_from("allgather", key) == math.inf


# -- the loads of the P ranges (skew) ----------------------------------------------------------
def _hot_loads(P: int, N: int, share: float) -> list[float]:
    """``share`` of the N nonzeros in range 0, the rest spread evenly."""
    return [share * N] + [(1 - share) * N / (P - 1)] * (P - 1)


def test_even_loads_predict_as_no_loads():
    for P in (2, 3, 8):
        N = P * 2**24 // 100
        even = predict(P, 2**24, N, I32, F32, loads=[N / P] * P)
        assert even == pytest.approx(predict(P, 2**24, N, I32, F32))


def test_loads_must_be_one_per_range():
    with pytest.raises(ValueError, match="expecting 4 loads, got 3"):
        predict(4, 1000, 40, I32, F32, loads=[10, 10, 20])


def test_skewed_loads_move_auto_off_dsa():
    """1% per rank of 16M: dsa on even loads; with 80% of the nonzeros in one owner's range
    dsa's busiest owner dominates and the choice leaves it."""
    for P in (4, 8):
        N = P * 2**24 // 100
        assert choose(P, 2**24, N, I32, F32, loads=[N / P] * P) == "dsa"
        skewed = _hot_loads(P, N, 0.8)
        assert choose(P, 2**24, N, I32, F32, loads=skewed) != "dsa"
        c, even = (predict(P, 2**24, N, I32, F32, loads=lo) for lo in (skewed, None))
        assert c["dsa"] > 2 * even["dsa"]
        for name in ("allgather", "recursive_doubling"):  # no range split: no change
            assert c[name] == even[name]


def test_dsa_charges_the_busiest_owner():
    """β only: the reduce-scatter's busiest owner receives max-load/P from each other rank,
    and the allgather sends the busiest range once per Bruck round."""
    m = CostModel(alpha=0.0, beta=1.0, gamma_merge=0.0, delta=0.0)
    P, n, N = 4, 10**7, 4000  # (sparse everywhere)
    loads = [2500, 500, 500, 500]
    K = union_size(P, n, N / P, None)
    K_hot = union_size(P, n / P, 2500 / P, None)
    want = (P - 1) * 2500 / P * 8 + (P - 1) / P * K * 8 + 2 * (K_hot - K / P) * 8
    assert predict(P, n, N, I32, F32, model=m, loads=loads)["dsa"] == pytest.approx(want)


def test_hashed_and_ring_only_when_registered(monkeypatch):
    from sparsecoll.algorithms import auto

    known = set(sparsecoll.available_algorithms())
    c = predict(8, 2**24, 8 * 2**24 // 100, I32, F32)
    assert ("hashed" in c) == ("hashed" in known) and ("ring" in c) == ("ring" in known)
    monkeypatch.setattr(auto, "_registered", lambda name: True)
    assert {"hashed", "ring"} <= set(predict(8, 2**24, 8 * 2**24 // 100, I32, F32))
    assert set(predict(1, 2**24, 2**24 // 100, I32, F32)).isdisjoint({"hashed", "ring"})
    assert {"hashed:compact", "ring:compact"} <= set(predict(8, 2**24, 8 * 2**24 // 100, I32, F32))
    monkeypatch.setattr(auto, "_registered", lambda name: False)
    got = set(predict(8, 2**24, 8 * 2**24 // 100, I32, F32))
    assert got.isdisjoint({"hashed", "ring", "hashed:compact", "ring:compact"})


def test_hashed_is_balanced_and_ring_suffers_the_skew(monkeypatch):
    from sparsecoll.algorithms import auto

    monkeypatch.setattr(auto, "_registered", lambda name: True)
    P, n = 8, 2**24
    N = P * n // 100
    even = predict(P, n, N, I32, F32)
    for share in (0.5, 0.8, 0.95):
        c = predict(P, n, N, I32, F32, loads=_hot_loads(P, N, share))
        assert c["hashed"] == even["hashed"]
        assert c["ring"] > even["ring"] and c["dsa"] > even["dsa"]
    c = predict(P, n, N, I32, F32, loads=_hot_loads(P, N, 0.95))
    assert c["hashed"] < c["dsa"] and c["hashed"] < c["ring"]
    # the pull returns each owner's part as a bitmap over its n/P indices where that is smaller
    m = CostModel(alpha=0.0, beta=1.0, gamma_merge=0.0, delta=0.0)
    dense_ish = predict(P, 8000, P * 4000, I32, F32, theta=1.0, model=m)["hashed"]
    part = min(8000 / P / 8 + 8000 / P * 4, 8000 / P * 4)
    assert dense_ish == pytest.approx((P - 1) * (min(500 * 8, 1000 * 4) + part))


def test_range_loads_counts_each_range():
    from sparsecoll.algorithms.auto import range_loads
    from sparsecoll.algorithms.base import range_bounds
    from sparsecoll.sparse import SparseVector

    rng = np.random.default_rng(0)
    idx = np.unique(rng.integers(0, 1001, 300))
    x = SparseVector.from_coo(idx, np.ones(idx.size, F32), 1001)
    for P in (1, 2, 3, 7):
        loads = range_loads(x, P)
        want = np.histogram(idx, bins=range_bounds(1001, P))[0]
        assert loads == want.tolist() and sum(loads) == idx.size
    # on the bounds and around them, the widest int32 n and past it, no nonzeros
    for n in (1001, 2**31, 2**33 + 5):
        for P in (2, 3, 8):
            bounds = range_bounds(n, P)
            near = np.concatenate(
                [bounds[:-1], bounds[1:] - 1, np.minimum(bounds[1:-1] + 1, n - 1)]
            )
            idx = np.unique(near)
            x = SparseVector.from_coo(idx, np.ones(idx.size, F32), n)
            assert x.indices.dtype == (np.int32 if n <= 2**31 else np.int64)
            want = np.histogram(idx, bins=bounds)[0].tolist()
            assert range_loads(x, P) == want and sum(want) == idx.size, (n, P)
            empty = SparseVector.from_coo(idx[:0], np.ones(0, F32), n)
            assert range_loads(empty, P) == [0] * P


@given(
    P=st.integers(2, 64),
    log_n=st.integers(4, 34),
    density=st.floats(0, 1),
    share=st.floats(0, 1),
)
def test_choice_with_loads_is_the_cheapest_candidate(P, log_n, density, share):
    n = 2**log_n
    N = int(P * density * n)
    loads = [share * N] + [(1 - share) * N / (P - 1)] * (P - 1)
    itype = np.int32 if n <= 2**31 else np.int64
    cost = predict(P, n, N, itype, F32, None, None, loads)
    assert all(math.isfinite(v) and v >= 0 for v in cost.values())
    assert cost[choose(P, n, N, itype, F32, None, None, loads)] == min(cost.values())


def test_why_is_a_read_only_mapping_of_the_call_made_when_read():
    """info["auto"]: the documented keys, equal to the dict they name, its samples as they
    were at the call (the tuner's later samples leave it), and nothing to write to."""
    import pickle

    from sparsecoll.algorithms._tune import Tuner
    from sparsecoll.algorithms.auto import Why

    tuner = Tuner()
    tuner.pick({"a": 1.0, "b": 1.2}, ORDER, KEY, 1000, 4, 2.5)
    tuner.samples = {"a": (2.0,)}
    cost = {"a": 1.0, "b": 1.2}
    model = CostModel(alpha=1e-6, beta=2e-9)
    why = Why("a", cost, 1000, [700, 300], 0.25, model, tuner)
    tuner.samples["a"] = (2.0, 3.0)  # (after the call)
    want = {
        "choice": "a", "predicted": cost, "nnz": 1000, "loads": [700, 300], "imbalance": 1.4,
        "theta": 0.25, "alpha": 1e-6, "beta": 2e-9, "contenders": ["a", "b"],
        "measured": {"a": (2.0,)},
    }  # fmt: skip
    assert list(why) == list(want) and len(why) == len(want)
    assert why == want and dict(why) == want and why["measured"] == {"a": (2.0,)}
    assert why.get("theta") == 0.25 and "loads" in why and "other" not in why
    assert why["predicted"] is not cost  # (a copy: the tuner's predictions stay its own)
    assert repr(why) == repr(want)
    assert pickle.loads(pickle.dumps(why)) == want
    with pytest.raises(TypeError):
        why["choice"] = "b"  # type: ignore[index]
    with pytest.raises(KeyError):
        why["other"]
