"""GradientReducer under MPI: error feedback loses nothing (every algorithm), dense is plain
averaging, exact algorithms match a simulation of every rank; checkpoints, stats, errors."""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import sparsecoll
from sparsecoll import CollectiveInputError, CollectiveTypeError
from sparsecoll.registry import algorithm_class
from sparsecoll.training import GradientReducer

from .cases import assert_all

ALGORITHMS = sparsecoll.available_algorithms()
GRAD_KINDS = ("gauss", "heavy", "many_zeros", "rows", "one_rank_zero", "growing", "ties")


@dataclasses.dataclass(frozen=True)
class Stream:
    n: int
    kind: str
    seed: int
    steps: int
    density: float
    warmup: int
    average: bool
    dtype: str = "float64"

    def grad(self, rank: int, step: int) -> np.ndarray:
        """Rank ``rank``'s gradient at ``step`` (any rank can rebuild any other's)."""
        rng = np.random.default_rng([self.seed, rank, step])
        n = self.n
        if self.kind == "heavy":
            g = rng.standard_t(2, n)
        elif self.kind == "many_zeros":
            g = rng.standard_normal(n) * (rng.random(n) < 0.05)
        elif self.kind == "rows":  # an embedding's gradient: a few of 20 blocks per step
            rows = np.zeros(20)
            rows[rng.integers(0, 20, 2)] = 1
            g = rng.standard_normal(n) * np.repeat(rows, -(-n // 20))[:n]
        elif self.kind == "one_rank_zero":
            g = np.zeros(n) if rank == 0 else rng.standard_normal(n)
        elif self.kind == "growing":
            g = rng.standard_normal(n) * 2.0**step
        elif self.kind == "ties":
            g = rng.integers(-2, 3, n).astype(np.float64)
        else:
            g = rng.standard_normal(n)
        return g.astype(self.dtype)


@st.composite
def streams(draw, dtype: str = "float64") -> Stream:
    return Stream(
        n=draw(st.one_of(st.integers(1, 40), st.integers(41, 3000))),
        kind=draw(st.sampled_from(GRAD_KINDS)),
        seed=draw(st.integers(0, 2**32 - 1)),
        steps=draw(st.integers(1, 4)),
        density=draw(st.sampled_from([0.001, 0.01, 0.05, 0.3, 1.0])),
        warmup=draw(st.integers(0, 2)),
        average=draw(st.booleans()),
        dtype=dtype,
    )


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def run(comm, s: Stream, algorithm: str, **kw) -> tuple[GradientReducer, list[np.ndarray]]:
    red = GradientReducer(comm, s.n, algorithm, s.density, warmup=s.warmup, average=s.average, **kw)
    return red, [red.step(s.grad(comm.rank, t)) for t in range(s.steps)]


def simulate(
    s: Stream, p: int, k: int, select: bool, momentum: float = 0.0
) -> tuple[list[np.ndarray], list, list]:
    """Every rank's reducer, simulated here: local top-k (or nothing when ``select`` is
    False: dense), exact sums; with ``momentum``, DGC's momentum correction (velocity
    accumulated, masked where sent on sparse steps). Returns the updates and every rank's
    final residual and velocity."""
    residual = [np.zeros(s.n) for _ in range(p)]
    velocity = [np.zeros(s.n) for _ in range(p)]
    updates = []
    for t in range(s.steps):
        total = np.zeros(s.n)
        for r in range(p):
            u = momentum * velocity[r] + s.grad(r, t)
            acc = residual[r] + u
            sparse = select and t >= s.warmup
            sel = reference_topk(acc, k) if sparse else slice(None)
            total[sel] += acc[sel]
            acc[sel] = 0
            if sparse:
                u[sel] = 0
            residual[r], velocity[r] = acc, u
        updates.append(total / p if s.average else total)
    return updates, residual, velocity


def reference_topk(x: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k largest |x| (ties to the lower position, zeros never), ascending."""
    order = np.lexsort((np.arange(x.shape[0]), -np.abs(x)))
    order = order[np.abs(x[order]) > 0][:k]
    return np.sort(order)


def check_everywhere(comm, problems: list[str], arrays: list[np.ndarray]) -> None:
    """One collective for all checks: every rank's problems, and ``arrays`` bit-identical."""
    every = comm.allgather_object((problems, [digest(a) for a in arrays]))
    bad = [f"rank {r}: {m}" for r, (probs, _) in enumerate(every) for m in probs]
    if any(d != every[0][1] for _, d in every):
        bad.append("updates differ across ranks")
    assert not bad, "; ".join(bad[:8])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(s=streams())
def test_error_feedback_loses_nothing(comm, algorithm, s):
    """sum of updates (× P when averaging) + sum of residuals == sum of every gradient;
    dense is plain averaging; exact algorithms equal a simulation of every rank."""
    red, updates = run(comm, s, algorithm)
    p = comm.size
    problems = []
    applied = np.sum(updates, axis=0) * (p if s.average else 1)
    residuals = comm.allreduce(np.asarray(red.residual, dtype=np.float64))
    grads = sum(s.grad(r, t) for r in range(p) for t in range(s.steps))
    scale = sum(np.abs(s.grad(r, t)) for r in range(p) for t in range(s.steps))
    err = np.abs(applied + residuals - grads)
    if not np.all(err <= 1e-12 * (scale + 1)):
        problems.append(f"{algorithm}: lost {err.max()!r} of the gradient")
    if any(u.shape != (s.n,) or u.dtype != np.float64 for u in updates):
        problems.append("update shape/dtype")
    if algorithm == "dense" or algorithm_class(algorithm).exact:
        want, residual, _ = simulate(s, p, red.k, select=algorithm != "dense")
        for t, (u, w) in enumerate(zip(updates, want)):
            if not np.allclose(u, w, rtol=1e-12, atol=1e-12 * (1 + np.abs(w).max())):
                problems.append(f"{algorithm} step {t} differs from the simulation")
        if not np.allclose(red.residual, residual[comm.rank], rtol=1e-12, atol=1e-12):
            problems.append("residual differs from the simulation")
    elif s.steps > s.warmup and not (algorithm == "exdyna" and s.kind == "ties"):
        # gtopk/oktopk: <= P·k. exdyna: about k (a window edge near k: within 5% once its
        # threshold has settled, tests/mpi/test_exdyna.py), so at P = 1 a little over P·k,
        # and a threshold keeps every entry tied at it
        bound = p * red.k if algorithm != "exdyna" else max(p, 2) * red.k
        if np.count_nonzero(updates[-1]) > bound:
            problems.append(f"update denser than {bound} entries")
    check_everywhere(comm, problems, updates)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(s=streams(), momentum=st.sampled_from([0.5, 0.9]))
def test_momentum_correction(comm, algorithm, s, momentum):
    """With momentum correction nothing is lost either: sum of updates (× P when averaging)
    + sum of residuals == sum of the velocities fed in (u = m·u + g, masked where sent);
    dense is momentum SGD's buffer; exact algorithms equal a simulation of every rank."""
    p = comm.size
    red = GradientReducer(
        comm, s.n, algorithm, s.density, warmup=s.warmup, average=s.average, momentum=momentum
    )
    updates, fed = [], np.zeros(s.n)
    for t in range(s.steps):
        before = np.zeros(s.n) if red.velocity is None else red.velocity
        fed += momentum * before + s.grad(comm.rank, t)
        updates.append(red.step(s.grad(comm.rank, t)))
    problems = []
    applied = np.sum(updates, axis=0) * (p if s.average else 1)
    residuals = comm.allreduce(np.asarray(red.residual, dtype=np.float64))
    fed_all = comm.allreduce(fed)
    scale = comm.allreduce(np.abs(fed)) * (s.steps + 1)
    err = np.abs(applied + residuals - fed_all)
    if not np.all(err <= 1e-12 * (scale + 1)):
        problems.append(f"{algorithm}: lost {err.max()!r} of the velocities")
    if algorithm == "dense" or algorithm_class(algorithm).exact:
        want, residual, velocity = simulate(s, p, red.k, algorithm != "dense", momentum)
        for t, (u, w) in enumerate(zip(updates, want)):
            if not np.allclose(u, w, rtol=1e-12, atol=1e-12 * (1 + np.abs(w).max())):
                problems.append(f"{algorithm} step {t} differs from the simulation")
        if not np.allclose(red.residual, residual[comm.rank], rtol=1e-12, atol=1e-12):
            problems.append("residual differs from the simulation")
        if not np.allclose(red.velocity, velocity[comm.rank], rtol=1e-12, atol=1e-12):
            problems.append("velocity differs from the simulation")
    check_everywhere(comm, problems, updates)


@given(s=streams(dtype="float32"))
def test_error_feedback_float32(comm, s):
    red, updates = run(comm, s, "allgather")
    p = comm.size
    applied = np.sum(np.asarray(updates, dtype=np.float64), axis=0) * (p if s.average else 1)
    residuals = comm.allreduce(np.asarray(red.residual, dtype=np.float64))
    grads = sum(s.grad(r, t).astype(np.float64) for r in range(p) for t in range(s.steps))
    scale = sum(np.abs(s.grad(r, t)).astype(np.float64) for r in range(p) for t in range(s.steps))
    problems = []
    if not np.all(np.abs(applied + residuals - grads) <= 1e-5 * (scale + 1)):
        problems.append("float32 error feedback lost more than rounding")
    if red.residual.dtype != np.float32 or any(u.dtype != np.float32 for u in updates):
        problems.append("residual/update dtype")
    check_everywhere(comm, problems, updates)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_checkpoint_restores_the_same_run(comm, algorithm):
    s = Stream(n=1500, kind="heavy", seed=7, steps=8, density=0.02, warmup=1, average=True)
    red, updates = run(comm, s, algorithm)
    red2 = GradientReducer(comm, s.n, algorithm, s.density, warmup=1)
    for t in range(4):
        red2.step(s.grad(comm.rank, t))
    saved = pickle.loads(pickle.dumps(red2.state_dict()))
    red3 = GradientReducer(comm, s.n, algorithm, s.density, warmup=1)
    red3.load_state_dict(saved)
    assert_all(comm, red3.steps == 4, "step counter not restored")
    for t in range(4, s.steps):
        u = red3.step(s.grad(comm.rank, t))
        assert_all(comm, np.array_equal(u, updates[t]), f"{algorithm} step {t} after restore")
    assert_all(comm, np.array_equal(red3.residual, red.residual), "residual after restore")
    # the saved state is a snapshot: stepping red2 further does not change it
    red2.step(s.grad(comm.rank, 4))
    assert_all(comm, saved["steps"] == 4, "state_dict aliases the live state")


@pytest.mark.parametrize("algorithm", ["allgather", "oktopk", "exdyna"])
def test_checkpoint_with_momentum(comm, algorithm):
    s = Stream(n=1500, kind="gauss", seed=3, steps=6, density=0.02, warmup=1, average=True)
    red = GradientReducer(comm, s.n, algorithm, s.density, warmup=1, momentum=0.9)
    updates = [red.step(s.grad(comm.rank, t)) for t in range(s.steps)]
    red2 = GradientReducer(comm, s.n, algorithm, s.density, warmup=1, momentum=0.9)
    for t in range(3):
        red2.step(s.grad(comm.rank, t))
    red3 = GradientReducer(comm, s.n, algorithm, s.density, warmup=1, momentum=0.9)
    red3.load_state_dict(pickle.loads(pickle.dumps(red2.state_dict())))
    for t in range(3, s.steps):
        u = red3.step(s.grad(comm.rank, t))
        assert_all(comm, np.array_equal(u, updates[t]), f"{algorithm} step {t} after restore")
    assert_all(comm, np.array_equal(red3.velocity, red.velocity), "velocity after restore")


def test_checkpoint_rejects_other_reducer(comm):
    red = GradientReducer(comm, 100, "allgather", 0.1)
    red.step(np.ones(100))
    state = red.state_dict()
    with pytest.raises(ValueError, match="n=100"):
        GradientReducer(comm, 101, "allgather", 0.1).load_state_dict(state)
    with pytest.raises(ValueError, match="algorithm='allgather'"):
        GradientReducer(comm, 100, "dense", 0.1).load_state_dict(state)
    # another density: the algorithm's state (its k) would disagree with the reducer's
    with pytest.raises(ValueError, match="density=0.1"):
        GradientReducer(comm, 100, "allgather", 0.2).load_state_dict(state)


def test_dense_float16_average_does_not_overflow(comm):
    """float16 gradients whose average fits in float16 but whose sum does not (60000 on
    every rank): the dense steps (warm-up, or algorithm="dense") average them exactly."""
    n = 64
    grad = np.full(n, 60000, np.float16)
    for algorithm, warmup in (("dense", 0), ("allgather", 1)):
        red = GradientReducer(comm, n, algorithm, 0.25, warmup=warmup)
        update = red.step(grad)
        ok = update.dtype == np.float16 and bool(np.all(update == 60000))
        assert_all(comm, ok, f"{algorithm}: {update[:4]}")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # (the sum's)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_sparse_float16_average_does_not_overflow(comm, algorithm):
    """float16 sparse steps whose sum overflows float16 where the average fits (30000 at one
    index on every rank, small values around it): the update holds the average there, not
    inf (each rank sends its share, value / P), the same on every rank, and the sent entry
    leaves the residual. Summed instead (average=False) it is inf once 30000·P passes
    float16's largest value, without an error (the loss scaler's cue to skip the batch);
    take_back() then puts the residual back as it was before that step."""
    n, p = 64, comm.size
    grad = (np.random.default_rng([7, comm.rank]).standard_normal(n) / 4).astype(np.float16)
    grad[3] = 30000
    red = GradientReducer(comm, n, algorithm, 0.125)
    update = red.step(grad)
    problems = []
    if update.dtype != np.float16 or update[3] != 30000 or not np.isfinite(update).all():
        problems.append(f"{algorithm}: average at 3 is {update[3]!r}, {update.dtype}")
    if red.residual[3] != 0:
        problems.append(f"{algorithm}: residual at 3 is {red.residual[3]!r}")
    summed = GradientReducer(comm, n, algorithm, 0.125, average=False)
    summed.step(grad[::-1].copy())
    before = summed.residual.copy()
    total = summed.step(grad)
    if bool(np.isinf(total[3])) != (30000 * p > 65504):
        problems.append(f"{algorithm}: sum at 3 is {total[3]!r} on {p} ranks")
    summed.take_back()
    if not np.array_equal(summed.residual, before):
        problems.append(f"{algorithm}: take_back did not restore the residual")
    check_everywhere(comm, problems, [update, total])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@given(s=streams(dtype="float16"))
def test_error_feedback_float16(comm, algorithm, s):
    """float16: what the update (× P when averaging) and the residuals miss of the gradients
    is rounding only: each grad + residual, each share value / P, each partial sum in
    float16 rounds once (2⁻¹¹ relative), a share may fall below the subnormals (2⁻²⁵)."""
    red, updates = run(comm, s, algorithm)
    p = comm.size
    wide = [np.asarray(u, dtype=np.float64) for u in updates]
    applied = np.sum(wide, axis=0) * (p if s.average else 1)
    residuals = comm.allreduce(np.asarray(red.residual, dtype=np.float64))
    grads = sum(s.grad(r, t).astype(np.float64) for r in range(p) for t in range(s.steps))
    scale = sum(np.abs(s.grad(r, t)).astype(np.float64) for r in range(p) for t in range(s.steps))
    tol = 2.0**-10 * (p + 2) * (s.steps + 1) * scale + s.steps * p * p * 2.0**-24
    problems = []
    err = np.abs(applied + residuals - grads)
    if not np.all(err <= tol):
        problems.append(f"{algorithm}: lost {err.max()!r} of the float16 gradient")
    if red.residual.dtype != np.float16 or any(u.dtype != np.float16 for u in updates):
        problems.append("residual/update dtype")
    check_everywhere(comm, problems, updates)


@pytest.mark.parametrize("algorithm", ["dense", "allgather", "exdyna"])
def test_stats_count_bytes(comm, algorithm):
    n, p = 4000, comm.size
    red = GradientReducer(comm, n, algorithm, density=0.01, warmup=1)
    rng = np.random.default_rng([5, comm.rank])
    sent, means, achieved = [], [red.stats()["mean_achieved_density"]], []
    for _ in range(3):
        red.step(rng.standard_normal(n).astype(np.float32))
        sent.append(red.stats()["bytes_sent"])
        means.append(red.stats()["mean_achieved_density"])
        achieved.append(red.stats()["achieved_density"])
    s = red.stats()
    # no step after the warm-up yet: None (it read 0.0, and 0.0 forever for "dense")
    assert_all(comm, means[:2] == [None, None], f"mean density before a sparse step: {means}")
    want = np.mean(achieved[1:])
    assert_all(comm, abs(means[-1] - want) < 1e-12, f"mean density {means[-1]} != {want}")
    dense = 2 * (p - 1) * n * 4 // p
    assert_all(comm, s["dense_bytes"] == dense, f"dense_bytes {s['dense_bytes']} != {dense}")
    assert_all(comm, sent[0] == dense, "the warm-up step is one dense allreduce")
    assert_all(comm, s["bytes_sent_total"] == sum(sent), "cumulative bytes")
    assert_all(comm, s["requested_density"] == 0.01 and s["steps"] == 3, "requested density")
    if algorithm == "dense":
        assert_all(comm, s["achieved_density"] == 1.0 and sent[-1] == dense, "dense stats")
    else:
        assert_all(comm, p == 1 or 0 < sent[-1] < dense / 5, f"sparse step sent {sent[-1]}")
        assert_all(comm, 0 < s["achieved_density"] <= p * 0.01 + 1e-12, "achieved density")
        assert_all(comm, s["selected_density"] <= 0.01 * 1.5, "selected density")


def test_bad_grad_on_one_rank_raises_everywhere(comm):
    n, p = 50, comm.size
    red = GradientReducer(comm, n, "allgather", 1.0)
    bad = p - 1
    g = np.ones(n + (comm.rank == bad))
    with pytest.raises(CollectiveInputError, match=f"grad must have 50 elements.*on rank {bad}"):
        red.step(g)
    g = np.ones(n, dtype=np.int64 if comm.rank == bad else np.float64)
    with pytest.raises(CollectiveTypeError, match=f"float64, got int64 on rank {bad}"):
        red.step(g)
    # nothing moved: the reducer goes on as if the failed calls never happened
    out = red.step(np.full(n, float(comm.rank)))
    assert_all(comm, red.steps == 1, "failed steps counted")
    want = np.full(n, sum(range(p)) / p)
    assert_all(comm, np.allclose(out, want), "step after an error")


def test_grad_dtype_differing_across_ranks(comm):
    """A float32 gradient on one rank and float64 on the others (each fine on its own rank)
    raises CollectiveTypeError naming both dtypes, as allreduce does for ``values`` (it was
    a CollectiveInputError, a ValueError, saying only that rank differs from rank 0)."""
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    red = GradientReducer(comm, 20, "allgather", 0.5)
    bad = comm.size - 1
    g = np.ones(20, dtype=np.float32 if comm.rank == bad else np.float64)
    with pytest.raises(
        CollectiveTypeError,
        match=f"grad dtype must be the same on every rank: rank {bad} has float32, "
        f"rank 0 has float64",
    ):
        red.step(g)
    assert_all(comm, red.steps == 0, "failed step counted")


def test_step_differing_across_ranks(comm):
    """Reducers at different steps (one rank's counter moved) raise on every rank with both
    counts (it said only that the rank differs from rank 0)."""
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    red = GradientReducer(comm, 20, "allgather", 0.5)
    bad = comm.size - 1
    if comm.rank == bad:
        red.steps = 3
    with pytest.raises(
        CollectiveInputError,
        match=f"step must be the same on every rank: rank {bad} has 3, rank 0 has 0",
    ):
        red.step(np.ones(20))


# (option, the other ranks' value, rank `bad`'s): every option that changes what the ranks
# do together or what a rank selects and keeps
DIFFERING_OPTIONS = {
    "warmup": (0, 1),
    "average": (True, False),
    "density": (0.1, 0.2),
    "error_feedback": (True, False),
    "momentum": (0.0, 0.9),
    "selection": ("exact", "sampling"),
    "selection_options": ({"interval": 8}, {"interval": 4}),
}


@pytest.mark.parametrize("option", list(DIFFERING_OPTIONS))
@pytest.mark.parametrize("algorithm", ["gtopk", "allgather", "dense"])
def test_reducer_options_differing_across_ranks(comm, option, algorithm):
    """A reducer built with another option on one rank raises on every rank at its first
    step, naming the option and both values. A longer warm-up made that rank's step a dense
    allreduce while the others ran gtopk's exchange: the job hung; ``average`` on some ranks
    only gave them another update (no error); another density (allgather, dense),
    error_feedback, momentum, selection or selection_options went on without an error, the
    ranks selecting or keeping differently."""
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    bad = comm.size - 1
    usual, odd = DIFFERING_OPTIONS[option]
    value = odd if comm.rank == bad else usual
    kw = {option: value}
    if option == "selection_options":
        kw["selection"] = "reuse"
    if option.startswith("selection") and algorithm == "dense":
        pytest.skip("dense selects nothing")
    red = GradientReducer(comm, 40, algorithm, **{"density": 0.1, **kw})
    name, shown = option, (repr(odd), repr(usual))
    if option == "selection_options":  # (the option that differs, with both values)
        name, shown = r"selection_options\['interval'\]", ("4", "8")
    with pytest.raises(
        CollectiveInputError,
        match=f"{name} must be the same on every rank: rank {bad} has {shown[0]}, rank 0 "
        f"has {shown[1]}",
    ):
        red.step(np.arange(40.0) + comm.rank)
    assert_all(comm, red.steps == 0, "failed step counted")


def test_an_array_option_is_agreed_by_its_values(comm):
    """A selection option given as a numpy array (band=np.array([lo, hi]), which the
    estimators take) is compared by its values: other values on one rank raise on every
    rank, naming both; the same values as an array or a tuple agree. Compared by its type
    alone, the ranks went on selecting with their own bands, without an error."""
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    bad = comm.size - 1
    band = np.array([0.8, 2.0 if comm.rank == bad else 1.25])
    kw = {"selection": "gaussian", "selection_options": {"band": band}}
    red = GradientReducer(comm, 400, "allgather", 0.05, **kw)
    with pytest.raises(
        CollectiveInputError,
        match=re.escape(
            f"selection_options['band'] must be the same on every rank: rank {bad} has "
            "(0.8, 2.0), rank 0 has (0.8, 1.25)"
        ),
    ):
        red.step(np.arange(400.0) + comm.rank)
    same = np.array([0.8, 1.25]) if comm.rank % 2 else (0.8, 1.25)
    kw["selection_options"] = {"band": same}
    red = GradientReducer(comm, 400, "allgather", 0.05, **kw)
    red.step(np.arange(400.0) + comm.rank)
    assert red.steps == 1


def test_reducer_options_alike_in_value_are_agreed(comm):
    """Options are agreed by value: a numpy scalar and the Python number are one density,
    a selection's seed may differ between ranks (each samples its own way), and a seed
    given as a Generator on every rank is not refused for the address in its repr (both
    raised 'must be the same on every rank')."""
    rank_value = np.float64(0.1) if comm.rank % 2 else 0.1
    for selection, options in (
        ("exact", {}),
        ("sampling", {"seed": comm.rank}),
        ("sampling", {"seed": np.random.default_rng(0)}),
        ("reuse", {"interval": np.int64(4) if comm.rank % 2 else 4}),
    ):
        red = GradientReducer(
            comm, 400, "allgather", rank_value, selection=selection, selection_options=options
        )
        red.step(np.arange(400.0) + comm.rank)
        assert red.steps == 1


class _OptionProbe(sparsecoll.Algorithm):
    """allgather with an option that may hold any object (a function)."""

    name = "option_probe"

    def __init__(self, k=None, scale=abs):
        self.k, self.scale = k, scale

    def reduce(self, comm, x):
        return sparsecoll.get_algorithm("allgather").reduce(comm, x)


def test_a_differing_step_with_an_unpicklable_option_raises_everywhere(comm):
    """A reducer whose algorithm option cannot be pickled (a lambda) on one rank: a
    differing grad dtype is raised on every rank as such. The mismatch's message gathers
    the options from every rank: the lambda's pickling failed on that rank alone, the
    others waiting in the gather for ever."""
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    if "option_probe" not in sparsecoll.available_algorithms():
        sparsecoll.register_algorithm(_OptionProbe)
    bad = comm.size - 1
    opts = {"scale": lambda v: v} if comm.rank == bad else {}
    red = GradientReducer(comm, 100, "option_probe", 0.1, **opts)
    dtype = np.float32 if comm.rank == bad else np.float64
    with pytest.raises(CollectiveTypeError, match="grad dtype must be the same on every rank"):
        red.step(np.ones(100, dtype))


def test_reducer_algorithm_or_its_option_differing_across_ranks(comm):
    """Another algorithm, or another option of it, on one rank: the error names it, with
    both values (it said only that the rank's algorithm or options differ)."""
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    bad = comm.size - 1
    odd = comm.rank == bad
    grad = np.arange(40.0) + comm.rank
    red = GradientReducer(comm, 40, "gtopk" if odd else "oktopk", 0.1)
    with pytest.raises(
        CollectiveInputError,
        match=f"algorithm must be the same on every rank: rank {bad} has 'gtopk', rank 0 "
        f"has 'oktopk'",
    ):
        red.step(grad)
    red = GradientReducer(comm, 40, "oktopk", 0.1, tau=2 if odd else 4)
    with pytest.raises(
        CollectiveInputError,
        match=f"tau must be the same on every rank: rank {bad} has 2, rank 0 has 4",
    ):
        red.step(grad)
    # the same options, another state: the message says so, naming no option, and what to
    # do; the reducer's reset() on every rank is one way out
    red = GradientReducer(comm, 40, "oktopk", 0.1)
    if odd:
        red.algorithm.threshold = 0.5
    with pytest.raises(
        CollectiveInputError,
        match=rf"algorithm options \(and the state of earlier calls\) .* rank {bad} differs "
        r"from rank 0 \(.*call its reset\(\), or its GradientReducer's, on every rank",
    ):
        red.step(grad)
    red.reset()
    assert_all(comm, red.step(grad).shape == (40,))


def test_density_is_read_only(comm):
    """A reducer's density cannot be set: before, setting it changed nothing but what
    stats() reported as requested (k, the algorithm and the selection kept the old one)."""
    red = GradientReducer(comm, 100, "allgather", 0.1)
    with pytest.raises(AttributeError):
        red.density = 0.5
    assert red.density == red.stats()["requested_density"] == 0.1 and red.k == 10


def test_dtype_change_and_shape(comm):
    red = GradientReducer(comm, 12, "allgather", 1.0)
    out = red.step(np.ones((3, 4), dtype=np.float32))
    assert_all(comm, out.shape == (3, 4) and out.dtype == np.float32, "shape kept")
    with pytest.raises(CollectiveTypeError, match="dtype changed from float32 to float64"):
        red.step(np.ones(12))


def test_options_are_validated(comm):
    with pytest.raises(ValueError, match="density"):
        GradientReducer(comm, 10, "allgather", 0.0)
    with pytest.raises(ValueError, match="warmup"):
        GradientReducer(comm, 10, "allgather", 0.1, warmup=-1)
    with pytest.raises(ValueError, match="momentum"):
        GradientReducer(comm, 10, "allgather", 0.1, momentum=1.0)
    with pytest.raises(sparsecoll.UnknownAlgorithmError):
        GradientReducer(comm, 10, "nope", 0.1)
    with pytest.raises(TypeError, match="takes wire, got tau"):
        GradientReducer(comm, 10, "allgather", 0.1, tau=3)
    # (it was Python's "OkTopk.__init__() got an unexpected keyword argument 'tua'")
    # (not k among the options it takes: the reducer refuses k)
    with pytest.raises(TypeError, match=r"'oktopk'\).* takes tau, .*got tua \(did you mean 'tau'"):
        GradientReducer(comm, 10, "oktopk", 0.1, tua=3)


@pytest.mark.parametrize(
    ("option", "value"),
    [("density", True), ("density", "0.5"), ("momentum", True), ("momentum", "0.5")],
)
def test_real_options_refuse_bools_and_strings(comm, option, value):
    """density and momentum are real numbers (numpy's too): density=True made a dense
    reducer (float(True) is 1.0) and strings were parsed, with no error."""
    kw = {"density": 0.5, option: value}
    with pytest.raises(TypeError, match=f"{option} must be a real number, got"):
        GradientReducer(comm, 10, "gtopk", **kw)
    kw[option] = np.float32(0.5)
    red = GradientReducer(comm, 10, "gtopk", **kw)
    assert_all(comm, getattr(red, option) == 0.5, "numpy scalar refused")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("bad_value", [np.nan, np.inf])
def test_nan_gradient_on_one_rank_raises_everywhere(comm, algorithm, bad_value):
    """One policy for every algorithm: NaN or Inf anywhere in one rank's grad + residual
    raises the same CollectiveInputError on every rank, naming ``grad`` and that rank, at
    that step; no rank's residual or velocity changes, and the reducer goes on."""
    n = 4000
    red = GradientReducer(comm, n, algorithm, 0.01, momentum=0.9)
    g = np.random.default_rng([6, comm.rank]).standard_normal(n)
    red.step(g)
    before = red.residual.copy(), red.velocity.copy()
    bad = comm.size - 1
    g2 = g.copy()
    if comm.rank == bad:
        g2[[17, 3001]] = bad_value  # two entries, wherever exdyna's partition lies
    with pytest.raises(sparsecoll.NonFiniteError, match=f"grad holds NaN or Inf.*rank {bad}"):
        red.step(g2)
    same = np.array_equal(red.residual, before[0]) and np.array_equal(red.velocity, before[1])
    assert_all(comm, same, "a failed step changed the residual or the velocity")
    assert_all(comm, red.steps == 1, "a failed step counted")
    red.step(g)  # and the reducer goes on
    assert_all(comm, red.steps == 2, "step counter")


@pytest.mark.parametrize("algorithm", ["allgather", "oktopk", "exdyna"])
def test_reset_equals_a_new_reducer(comm, algorithm):
    """reset() drops residual, velocity, algorithm and selection state and statistics: the
    next steps equal those of a newly built reducer."""
    s = Stream(n=3000, kind="heavy", seed=4, steps=4, density=0.02, warmup=1, average=True)
    red, _ = run(comm, s, algorithm, momentum=0.5)
    red.reset()
    assert red.residual is None and red.velocity is None and red.steps == 0
    assert red.stats()["bytes_sent_total"] == 0
    fresh = GradientReducer(comm, s.n, algorithm, s.density, warmup=1, momentum=0.5)
    problems = []
    for t in range(s.steps):
        g = s.grad(comm.rank, t)
        if not np.array_equal(red.step(g), fresh.step(g)):
            problems.append(f"step {t} differs from a new reducer")
    check_everywhere(comm, problems, [])


@pytest.mark.parametrize("algorithm", ["dense", "allgather", "gtopk", "oktopk", "exdyna"])
@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_take_back_restores_the_memory(comm, algorithm, momentum):
    """take_back() after a step whose update is dropped puts the residual and the velocity
    back bit for bit, so error feedback loses nothing over the steps kept; a second
    take_back in a row (nothing to take back) raises."""
    s = Stream(n=3000, kind="heavy", seed=6, steps=6, density=0.02, warmup=1, average=True)
    red = GradientReducer(comm, s.n, algorithm, s.density, warmup=1, momentum=momentum)
    problems, kept = [], []
    for t in range(s.steps):
        before = [np.zeros(s.n) if a is None else a.copy() for a in (red.residual, red.velocity)]
        update = red.step(s.grad(comm.rank, t))
        if t in (0, 2, 3):  # these batches are skipped (the warm-up step among them)
            red.take_back()
            for name, a, b in zip(("residual", "velocity"), (red.residual, red.velocity), before):
                if not np.array_equal(np.zeros(s.n) if a is None else a, b):  # (None: zeros)
                    problems.append(f"step {t}: {name} differs after take_back")
            if t == 3:
                with pytest.raises(RuntimeError, match="no step to take back"):
                    red.take_back()
        else:
            kept.append((t, update))
    if momentum == 0.0:
        p = comm.size
        applied = sum(u for _, u in kept) * p
        residuals = comm.allreduce(np.asarray(red.residual, dtype=np.float64))
        grads = sum(s.grad(r, t) for r in range(p) for t, _ in kept)
        scale = sum(np.abs(s.grad(r, t)) for r in range(p) for t, _ in kept)
        err = np.abs(applied + residuals - grads)
        if not np.all(err <= 1e-12 * (scale + 1)):
            problems.append(f"lost {err.max()!r} of the kept gradients")
    check_everywhere(comm, problems, [u for _, u in kept])


def test_no_take_back_after_a_failed_step(comm):
    """A step that fails (here: a wrong size on the last rank, raised on every rank) leaves
    nothing to take back on any rank: before, the ranks whose input passed its local checks
    refused, the last rank took back the step before (already applied)."""
    red = GradientReducer(comm, 6, "allgather", 0.5)
    red.step(np.arange(6.0))
    bad = comm.rank == comm.size - 1
    with pytest.raises(CollectiveInputError):
        red.step(np.arange(5.0 if bad else 6.0))
    residual = red.residual.copy()
    with pytest.raises(RuntimeError, match="no step to take back"):
        red.take_back()
    assert_all(comm, np.array_equal(red.residual, residual), "take_back changed the residual")


@pytest.mark.parametrize(
    ("algorithm", "selection"),
    [("allgather", "exact"), ("exdyna", "exact"), ("allgather", "reuse"), ("oktopk", "reuse")],
)
def test_out_buffer(comm, algorithm, selection):
    """step(grad, out=buf) writes the update into buf (grad itself allowed) and returns it;
    reuse_update=True returns one buffer, updated in O(k), equal to a fresh update (also
    with the reuse selection, which sends the pass's hits as they are)."""
    n = 2000
    opts = {} if algorithm == "exdyna" else {"selection": selection}
    red = GradientReducer(comm, n, algorithm, 0.02, warmup=1, **opts)
    reuse = GradientReducer(comm, n, algorithm, 0.02, warmup=1, reuse_update=True, **opts)
    twin = GradientReducer(comm, n, algorithm, 0.02, warmup=1, **opts)
    problems = []
    first = None
    for t in range(6):
        g = np.random.default_rng([t, comm.rank]).standard_normal(n)
        want = twin.step(g)
        buf = g.copy()
        if red.step(buf, out=buf) is not buf or not np.array_equal(buf, want):
            problems.append(f"step {t}: out differs")
        got = reuse.step(g)
        if not np.array_equal(got, want) or (t and not np.shares_memory(got, first)):
            problems.append(f"step {t}: reused update differs")
        first = got if first is None else first
    with pytest.raises(sparsecoll.CollectiveInputError, match="out must have"):
        red.step(g, out=np.empty(n - 1))
    check_everywhere(comm, problems, [])


@pytest.mark.parametrize("selection", ["reuse", "sampling", "gaussian"])
def test_selection_policies(comm, selection):
    """Threshold estimators as the local selection: nothing lost, checkpoint keeps their state."""
    s = Stream(n=3000, kind="heavy", seed=9, steps=6, density=0.02, warmup=0, average=True)
    opts = {"selection": selection}
    if selection == "reuse":
        opts["selection_options"] = {"interval": 3}
    red, updates = run(comm, s, "oktopk", **opts)
    p = comm.size
    residuals = comm.allreduce(np.asarray(red.residual, dtype=np.float64))
    grads = sum(s.grad(r, t) for r in range(p) for t in range(s.steps))
    lost = np.abs(np.sum(updates, axis=0) * p + residuals - grads).max()
    problems = [] if lost <= 1e-9 else [f"lost {lost!r}"]
    red2, _ = run(comm, dataclasses.replace(s, steps=3), "oktopk", **opts)
    red3 = GradientReducer(comm, s.n, "oktopk", s.density, **opts)
    red3.load_state_dict(pickle.loads(pickle.dumps(red2.state_dict())))
    for t in range(3, s.steps):
        if not np.array_equal(red3.step(s.grad(comm.rank, t)), updates[t]):
            problems.append(f"step {t} differs after restore")
    check_everywhere(comm, problems, updates)


REUSE_KINDS = ("gauss", "rise", "drop", "shift", "ties")


def reuse_grad(kind: str, seed: int, n: int, rank: int, p: int, step: int) -> np.ndarray:
    """Streams that move a reused threshold: error feedback's growing residual (every kind),
    a scale rising 3x a step or dropping 100x at step 3, one rank 1000x larger in turn,
    small integers (ties)."""
    g = np.random.default_rng([seed, rank, step]).standard_normal(n)
    if kind == "rise":
        g *= 3.0**step
    elif kind == "drop" and step >= 3:
        g *= 0.01
    elif kind == "shift" and rank == (step // 3) % p:
        g *= 1000.0
    elif kind == "ties":
        g = np.round(g * 2)
    return g


@pytest.mark.parametrize("algorithm", ["allgather", "gtopk", "oktopk"])
@given(
    kind=st.sampled_from(REUSE_KINDS),
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(500, 4000),
    density=st.sampled_from([0.005, 0.02, 0.1]),
    interval=st.sampled_from([4, 32]),
)
def test_reuse_selection_holds_its_band(comm, algorithm, kind, seed, n, density, interval):
    """selection="reuse" keeps every step's own selection within the band (k on exact steps,
    [0.8k, 1.25k] on reuse steps; fewer only when fewer entries are nonzero), also while
    error feedback lifts the accumulated values over the reused threshold and after jumps
    in scale; nothing is lost."""
    p, steps = comm.size, 10
    red = GradientReducer(
        comm, n, algorithm, density, selection="reuse", selection_options={"interval": interval}
    )
    k, problems, updates = red.k, [], []
    for t in range(steps):
        g = reuse_grad(kind, seed, n, comm.rank, p, t)
        acc = g + (red.residual if red.residual is not None else 0.0)
        updates.append(red.step(g))
        count = round(red.stats()["selected_density"] * n)
        lo = min(0.8 * k, np.count_nonzero(acc))
        if not lo <= count <= 1.25 * k:
            problems.append(f"step {t}: selected {count}, k = {k}, band [{lo}, {1.25 * k}]")
    residuals = comm.allreduce(np.asarray(red.residual, dtype=np.float64))
    grads = sum(reuse_grad(kind, seed, n, r, p, t) for r in range(p) for t in range(steps))
    total = np.sum(updates, axis=0) * p + residuals
    if not np.allclose(total, grads, rtol=1e-12, atol=1e-12 * np.abs(grads).max()):
        problems.append(f"lost {np.abs(total - grads).max()!r}")
    check_everywhere(comm, problems, updates)


def test_hook_state_reset(comm):
    """SparseHookState.reset() resets every bucket's reducer (no torch needed to check)."""
    from sparsecoll.integrations.torch import SparseHookState

    state = SparseHookState(comm, "oktopk", density=0.05)
    red = state.reducer(0, 500, "torch.float32")
    red.step(np.random.default_rng([2, comm.rank]).standard_normal(500).astype(np.float32))
    state.reset()
    assert state.reducers[0] is red and red.residual is None and red.steps == 0
    assert red.algorithm.step == 0 and state.stats()["bytes_sent_total"] == 0


def test_hook_state_stats_keep_a_replaced_buckets_traffic(comm):
    """A bucket whose layout changes after the warm-up gets a new reducer: the old one's
    bytes stay in SparseHookState.stats()'s totals (they went down: 1200 to 480 at P = 2)."""
    from sparsecoll.integrations.torch import SparseHookState

    state = SparseHookState(comm, "allgather", density=0.1)
    red = state.reducer(0, 500, "torch.float32")
    for t in range(3):
        red.step(np.random.default_rng([t, comm.rank]).standard_normal(500).astype(np.float32))
    before = state.stats()
    with pytest.warns(RuntimeWarning, match="changed"):
        new = state.reducer(0, 600, "torch.float32")
    new.step(np.ones(600, np.float32))
    after = state.stats()
    sent = before["bytes_sent_total"] + new.stats()["bytes_sent_total"]
    recv = before["bytes_recv_total"] + new.stats()["bytes_recv_total"]
    assert after["bytes_sent_total"] == sent and after["bytes_recv_total"] == recv
    state.reset()
    assert state.stats()["bytes_sent_total"] == 0


@pytest.mark.parametrize(
    ("algorithm", "options"),
    [("allgather", {}), ("oktopk", {"selection": "reuse"}), ("exdyna", {"momentum": 0.5})],
)
def test_hook_state_density_change_carries_the_residual(comm, algorithm, options):
    """Setting SparseHookState.density between iterations (a sparsity warm-up) rebuilds the
    bucket's reducer at the new density (k 50 -> 150 of 500) with its residual, velocity,
    step count and byte counts: without momentum, error feedback loses nothing across the
    change. Before, the new density was ignored (k stayed 50) while stats() reported it
    as requested."""
    from sparsecoll.integrations.torch import SparseHookState

    n, p = 500, comm.size
    state = SparseHookState(comm, algorithm, density=0.1, **options)
    fed, applied, problems = np.zeros(n), np.zeros(n), []
    for t in range(6):
        red = state.reducer(0, n, "torch.float64")
        if t == 3:
            kept = (red.residual.copy(), red.velocity, red.steps, red.stats()["bytes_sent_total"])
            state.density = 0.3
            red = state.reducer(0, n, "torch.float64")
            now = (red.residual, red.velocity, red.steps, state.stats()["bytes_sent_total"])
            if red.k != 150 or not all(np.array_equal(a, b) for a, b in zip(kept, now)):
                problems.append(f"after the change: k {red.k}, {now[2:]} against {kept[2:]}")
        grad = np.random.default_rng([t, comm.rank]).standard_normal(n)
        fed += grad
        applied += red.step(grad)
    if state.stats()["requested_density"] != 0.3:
        problems.append(f"requested density {state.stats()['requested_density']}")
    lost = applied * p + comm.allreduce(red.residual) - comm.allreduce(fed)
    if "momentum" not in options and not np.abs(lost).max() < 1e-9:
        problems.append(f"lost {np.abs(lost).max()!r} of the gradient")
    check_everywhere(comm, problems, [applied])
    with pytest.raises(ValueError, match="density must be in"):
        state.density = 1.5


def test_hook_state_checkpoint_is_checked_where_it_is_loaded(comm):
    """SparseHookState.load_state_dict() checks the saved state on every rank alike: one
    rank loading a state of another algorithm, another error_feedback, of another
    iteration, an iteration that is no integer >= 0, a bucket index or layout that no
    bucket could match, or with saved layouts that are no dict, raises the same error on every rank,
    naming it, and every state is left as it was; a state saved at another density is
    taken, residual and step count carried over. Before, any state loaded, and the
    bucket's first sparse iteration raised a ValueError inside the hook on that rank alone
    (the others waited in the step's agreement); a state saved with error_feedback=False
    loaded silently, and bad layouts raised a TypeError on that rank alone, after the
    ranks had agreed."""
    from sparsecoll.integrations.torch import SparseHookState

    n, bad = 300, comm.size - 1

    def trained(algorithm, **options):
        state = SparseHookState(comm, algorithm, density=0.1, **options)
        red = state.reducer(0, n, "torch.float32")
        for t in range(3):
            red.step(np.random.default_rng([t, comm.rank]).standard_normal(n).astype(np.float32))
        return state, pickle.loads(pickle.dumps(state.state_dict()))

    state, saved = trained("allgather")
    _, other = trained("gtopk")
    _, no_feedback = trained("allgather", error_feedback=False)
    red = state.reducers[0]
    cases = [
        (other, f"bucket 0: state is for algorithm='gtopk'.* on rank {bad}"),
        (no_feedback, f"bucket 0: state is for error_feedback=False, this .* on rank {bad}"),
        # (read after the ranks agreed: it raised a TypeError on that rank alone, the state
        # half-loaded)
        ({**saved, "layouts": None}, f"layouts must be a dict, got NoneType on rank {bad}"),
        # (int() took these: 2.7 as 2, "3" as 3)
        (
            {**saved, "iteration": 2.7},
            f"iteration must be an integer >= 0, got 2.7 .*on rank {bad}",
        ),
        (
            {**saved, "iteration": "3"},
            f"iteration must be an integer >= 0, got '3' .*on rank {bad}",
        ),
        ({**saved, "iteration": -1}, f"iteration must be an integer >= 0, got -1 on rank {bad}"),
        # (a bucket index or layout no bucket could match: dropped later, on a warning)
        (
            {**saved, "reducers": {"0": saved["reducers"][0]}, "layouts": {}},
            f"bucket index must be an integer >= 0, got '0' .*on rank {bad}",
        ),
        (
            {**saved, "layouts": {0: list(saved["layouts"][0])}},
            f"layout of bucket 0 must be \\(n={n}, .* on rank {bad}",
        ),
    ]
    if comm.size > 1:
        cases.append(({**saved, "iteration": 7}, "iteration must be the same on every rank"))
    for wrong, match in cases:
        state.iteration = 5
        with pytest.raises((CollectiveInputError, CollectiveTypeError), match=match):
            state.load_state_dict(wrong if comm.rank == bad else saved)
        assert_all(comm, state.iteration == 5 and state.reducers == {0: red}, "state changed")
    denser = SparseHookState(comm, "allgather", density=0.2)
    denser.load_state_dict(saved)
    got = denser.reducer(0, n, "torch.float32")
    ok = got.k == 60 and got.steps == 3 and np.array_equal(got.residual, red.residual)
    assert_all(comm, ok, f"restored at density 0.2: k {got.k}, {got.steps} steps")


@pytest.mark.parametrize("bad", ["other_n", "not_a_state", "other_step"])
def test_checkpoint_one_rank_cannot_take_is_refused_on_every_rank(comm, bad):
    """GradientReducer.load_state_dict is collective: a state one rank cannot take (or one
    saved at another step than the others') raises the same error on every rank, naming
    it, and no rank loads (it raised on that rank alone: the others loaded and went on
    from a state that rank did not have, or waited for it in their next step)."""
    if comm.size == 1 and bad == "other_step":
        pytest.skip("needs two ranks to disagree")
    n, last = 64, comm.size - 1
    g = np.random.default_rng([6, comm.rank]).standard_normal(n)
    red = GradientReducer(comm, n, "allgather", 0.1)
    red.step(g)
    state = red.state_dict()
    if comm.rank == last:
        if bad == "other_n":
            state = GradientReducer(comm, n + 1, "allgather", 0.1).state_dict()
        elif bad == "not_a_state":
            state = [state]
        else:  # (as saved one step later: a step on this rank alone would be no step)
            state = {**state, "steps": state["steps"] + 1}
    fresh = GradientReducer(comm, n, "allgather", 0.1)
    etype = CollectiveTypeError if bad == "not_a_state" else CollectiveInputError
    with pytest.raises(etype, match=f"(on rank|: rank) {last}"):
        fresh.load_state_dict(state)
    assert_all(comm, fresh.steps == 0 and fresh.residual is None, "a rank loaded")
    fresh.step(g)  # (the ranks go on together)


def test_checkpoint_of_another_rank_is_refused(comm):
    """Each rank restores the state it saved. The usual DDP habit, saving on rank 0 alone and
    loading that on every rank, gave every rank rank 0's residual (counted P times, the
    others' lost) without a word: now both collective loads, GradientReducer's and the
    hook's, raise the same CollectiveInputError on every rank, naming rank 1, and change
    nothing; each rank's own state loads."""
    from sparsecoll.integrations.torch import SparseHookState

    n = 300
    g = np.random.default_rng([4, comm.rank]).standard_normal(n).astype(np.float32)
    red = GradientReducer(comm, n, "allgather", 0.1)
    red.step(g)
    first = comm.bcast_object(red.state_dict(), 0)
    other = GradientReducer(comm, n, "allgather", 0.1)
    if comm.size > 1:
        with pytest.raises(
            CollectiveInputError, match="is for rank=0, this reducer has 1 .* rank 1"
        ):
            other.load_state_dict(first)
        assert_all(comm, other.steps == 0 and other.residual is None, "state changed")
    state = SparseHookState(comm, "allgather", density=0.1)
    state.reducer(0, n, "torch.float32").step(g)
    first = comm.bcast_object(state.state_dict(), 0)
    fresh = SparseHookState(comm, "allgather", density=0.1)
    if comm.size > 1:
        with pytest.raises(CollectiveInputError, match="bucket 0: state is for rank=0.* on rank 1"):
            fresh.load_state_dict(first)
        assert_all(comm, fresh.iteration == 0 and not fresh._pending, "state changed")
    fresh.load_state_dict(state.state_dict())
    got = fresh.reducer(0, n, "torch.float32")
    assert_all(comm, np.array_equal(got.residual, red.residual), "own state after refusal")


def test_restored_state_of_another_dtype_says_so_on_every_rank(comm):
    """A state saved from float64 gradients, restored and stepped with float32 ones, raises
    the same CollectiveTypeError on every rank at every step, naming the state's dtype, the
    gradient's and the ways out, and changes nothing. Before, it said "grad dtype changed
    from float64 to float32", of gradients this reducer was never given. Each way out works:
    float64 gradients go on as the saved run, the state cast to float32 loads and steps in
    float32, and reset() drops it."""
    n, last = 200, comm.size - 1
    g = [np.random.default_rng([5, comm.rank, t]).standard_normal(n) for t in range(3)]
    red = GradientReducer(comm, n, "oktopk", 0.05, momentum=0.5)
    for t in range(2):
        red.step(g[t])
    state = pickle.loads(pickle.dumps(red.state_dict()))
    fresh = GradientReducer(comm, n, "oktopk", 0.05, momentum=0.5)
    fresh.load_state_dict(state)
    wrong = g[2].astype(np.float32) if comm.rank == last else g[2]
    match = (
        r"saved from float64 gradients \(step with those, load it with its residual and "
        rf"velocity cast to float32, or reset\(\) to drop it\), grad is float32 on rank {last}"
    )
    for _ in range(2):
        with pytest.raises(CollectiveTypeError, match=match):
            fresh.step(wrong)
    assert_all(comm, fresh.steps == 2 and fresh.residual.dtype == np.float64, "state changed")
    problems = [] if np.array_equal(fresh.step(g[2]), red.step(g[2])) else ["float64 differs"]
    cast = {key: state[key].astype(np.float32) for key in ("residual", "velocity")}
    narrow = GradientReducer(comm, n, "oktopk", 0.05, momentum=0.5)
    narrow.load_state_dict({**state, **cast})
    if narrow.step(g[2].astype(np.float32)).dtype != np.float32:
        problems.append("the cast state did not step in float32")
    fresh.reset()
    fresh.step(g[0].astype(np.float32))
    check_everywhere(comm, problems, [])


def _edit_algorithm_state(state, case, size):
    """``state`` (a GradientReducer's, n = 600) as another sparsecoll or configuration would
    have saved it: the ``case`` of test_algorithm_state_it_cannot_take_is_refused."""
    algo = state["algorithm_state"]
    if case == "unknown attribute":
        algo["later"] = 1
    elif case == "missing attribute":
        del algo["_cooldown_side"]
    elif case == "other option, unrecorded":
        algo["tau"] = 8
        del state["options"]
    elif case == "other k, unrecorded density":
        algo["k"] += 1
        del state["density"]
    elif case == "threshold not a number":
        algo["threshold"] = "0.5"
    elif case == "regions of more ranks":
        algo["_shape"] = (600, size + 1)
        algo["boundaries"] = np.linspace(0, 600, size + 2).astype(np.int64)
        del state["ranks"]
    elif case == "partitions of more ranks":
        algo["size"] = size + 1
        algo["bounds"] = np.arange(size + 2, dtype=np.int64)
        del state["ranks"]
    elif case == "partitions out of order":
        algo["bounds"] = algo["bounds"][::-1]
    else:  # "newer state version"
        state["algorithm_version"] = 2


ALGORITHM_STATE_CASES = {
    "unknown attribute": ("oktopk", "holds later, which oktopk here does not have"),
    "missing attribute": ("exdyna", "algorithm_state lacks _cooldown_side: not the state of"),
    "other option, unrecorded": ("oktopk", "has tau=8, this reducer's oktopk has 32"),
    "other k, unrecorded density": ("exdyna", "has k=16, this reducer's exdyna has 15"),
    "threshold not a number": ("oktopk", "oktopk's threshold must be a real number, got str"),
    "regions of more ranks": ("oktopk", "boundaries has {b} bounds (for {more} ranks), this"),
    "partitions of more ranks": ("exdyna", "exdyna's size is for {more} ranks, this comm"),
    "partitions out of order": ("exdyna", "exdyna's bounds must ascend from 0"),
    "newer state version": ("oktopk", "oktopk's state version 2, this sparsecoll's oktopk"),
}


@pytest.mark.parametrize("case", list(ALGORITHM_STATE_CASES))
def test_algorithm_state_it_cannot_take_is_refused(comm, case):
    """The algorithm's state is checked before it is restored: its attribute names (another
    sparsecoll's, another algorithm's), its options (a state from before they were recorded
    in it), the kind of each value, partitions for this n and number of ranks, its version.
    One rank's state it cannot take raises the same error on every rank, naming that rank
    and what is wrong, and nothing loads. Before, the saved attributes were written over
    the instance as they were: a later attribute was added, a missing one kept its fresh
    value beside the saved others, options and k were replaced, and every step after
    failed (a threshold of text, exdyna set up for other ranks) or ran with what it held."""
    algorithm, match = ALGORITHM_STATE_CASES[case]
    n, last = 600, comm.size - 1
    g = [np.random.default_rng([8, comm.rank, t]).standard_normal(n) for t in range(3)]
    red = GradientReducer(comm, n, algorithm, 0.025)
    for t in range(2):
        red.step(g[t])
    state = pickle.loads(pickle.dumps(red.state_dict()))
    if comm.rank == last:
        _edit_algorithm_state(state, case, comm.size)
    fresh = GradientReducer(comm, n, algorithm, 0.025)
    match = re.escape(match.format(more=comm.size + 1, b=comm.size + 2)) + f".* rank {last}"
    with pytest.raises((CollectiveInputError, CollectiveTypeError), match=match):
        fresh.load_state_dict(state)
    assert_all(comm, fresh.steps == 0 and fresh.residual is None, "a rank loaded")
    fresh.load_state_dict(red.state_dict())  # (its own state: loads, and goes on alike)
    check_everywhere(comm, [], [fresh.step(g[2]), red.step(g[2])])


SELECTION_STATE_CASES = {
    # case: (selection, what the last rank's state is edited to, message)
    "reuse interval, unrecorded": ("reuse", {"interval": 4}, "has interval=4, this reducer's"),
    "reuse threshold of text": ("reuse", {"_t": "x"}, "reuse's _t must be a real number"),
    "sampler not a generator": ("sampling", {"rng": 0}, "sampling's rng must be a numpy random"),
    "exact with a slot": ("exact", {"_t": 1.0}, "holds _t, which exact here does not have"),
}


@pytest.mark.parametrize("case", list(SELECTION_STATE_CASES))
def test_selection_state_it_cannot_take_is_refused(comm, case):
    """The selection estimator's saved state is checked (options, kinds, slot names) on
    every rank alike: one rank's state it cannot take raises the same error on every rank,
    naming that rank, and nothing loads. Before, it was written over that rank's
    estimator as it came: another interval ran there (the state lacking
    selection_options), a threshold of text failed at that rank's every step."""
    selection, edit, match = SELECTION_STATE_CASES[case]
    n, last = 600, comm.size - 1
    g = [np.random.default_rng([9, comm.rank, t]).standard_normal(n) for t in range(3)]
    kw = {"selection": selection}
    if selection == "sampling":
        kw["selection_options"] = {"min_sample": 64}
    red = GradientReducer(comm, n, "allgather", 0.025, **kw)
    for t in range(2):
        red.step(g[t])
    state = pickle.loads(pickle.dumps(red.state_dict()))
    if comm.rank == last:
        state["selection_state"].update(edit)
        state.pop("selection_options")
    fresh = GradientReducer(comm, n, "allgather", 0.025, **kw)
    with pytest.raises((CollectiveInputError, CollectiveTypeError), match=f"{match}.* rank {last}"):
        fresh.load_state_dict(state)
    assert_all(comm, fresh.steps == 0 and fresh.residual is None, "a rank loaded")
    fresh.load_state_dict(red.state_dict())
    check_everywhere(comm, [], [fresh.step(g[2]), red.step(g[2])])


@pytest.mark.parametrize(
    ("algorithm", "selection"),
    [("allgather", "reuse"), ("oktopk", "reuse"), ("allgather", "sampling")],
)
def test_failed_step_leaves_the_selection_as_it_was(comm, algorithm, selection):
    """A step that fails on one rank (NaN there) changes nothing on any rank, the selection
    included: a ReuseThreshold's recompute schedule and nudges, a sampler's generator. The
    good ranks had selected before the verdict; later steps equal a run without that call."""
    n = 3000
    opts = {"interval": 3} if selection == "reuse" else {"min_sample": 64}
    kw = {"selection": selection, "selection_options": opts}
    red = GradientReducer(comm, n, algorithm, 0.02, **kw)
    twin = GradientReducer(comm, n, algorithm, 0.02, **kw)
    problems = []
    for t in range(7):
        g = np.random.default_rng([t, comm.rank]).standard_t(2, n)
        if t == 2:
            bad = g.copy()
            if comm.rank == comm.size - 1:
                bad[5] = np.nan
            with pytest.raises(sparsecoll.NonFiniteError):
                red.step(bad)
        if not np.array_equal(red.step(g), twin.step(g)):
            problems.append(f"step {t} differs from a run without the failed call")
    check_everywhere(comm, problems, [])


@pytest.mark.parametrize("algorithm", ["dense", "allgather", "oktopk"])
def test_read_only_out_on_one_rank_raises_everywhere(comm, algorithm):
    """out= read-only on one rank is an input error on every rank, before the collective
    (it was Numba's TypingError, or a BufferError, on that rank alone: the others went on
    or hung, and the step counters parted for good)."""
    n = 600
    red = GradientReducer(comm, n, algorithm, 1.0)
    bad = comm.size - 1
    out = np.zeros(n)
    out.flags.writeable = comm.rank != bad
    with pytest.raises(CollectiveInputError, match=f"out must be writeable.*on rank {bad}"):
        red.step(np.ones(n), out=out)
    assert_all(comm, red.steps == 0, "a failed step counted")
    update = red.step(np.full(n, float(comm.rank)))
    assert_all(comm, np.allclose(update, sum(range(comm.size)) / comm.size), "step after")


def test_checkpoint_rejects_other_options(comm):
    """A state from another density, number of ranks, selection or momentum is refused,
    with a message naming what differs, and the reducer is left as it was (loaded, oktopk
    and exdyna went on with the saved k while the reducer said the new density; another
    P's residuals were taken rank by rank, those of the missing ranks lost)."""
    n = 1000
    g = np.random.default_rng([1, comm.rank]).standard_normal(n)
    cases = [
        ({}, {"density": 0.1}, "density=0.02"),
        ({}, {"selection": "reuse"}, "selection='exact'"),
        ({"selection": "sampling"}, {"selection": "gaussian"}, "selection='sampling'"),
        ({"momentum": 0.9}, {}, "momentum=0.9"),
    ]
    for algorithm in ("allgather", "oktopk", "exdyna"):
        for saved_kw, kw, match in cases:
            if algorithm == "exdyna" and "selection" in {**saved_kw, **kw}:
                continue  # (exdyna takes no selection estimator: refused when built)
            red = GradientReducer(comm, n, algorithm, **{"density": 0.02, **saved_kw})
            red.step(g)
            other = GradientReducer(comm, n, algorithm, **{"density": 0.02, **kw})
            with pytest.raises(ValueError, match=match):
                other.load_state_dict(red.state_dict())
            assert other.steps == 0 and other.residual is None
        state = red.state_dict()
        state["ranks"] = comm.size + 1
        with pytest.raises(ValueError, match=f"ranks={comm.size + 1}"):
            GradientReducer(comm, n, algorithm, 0.02).load_state_dict(state)
    # a state saved before these were recorded still loads (and one with them, of course)
    red = GradientReducer(comm, n, "exdyna", 0.02)
    red.step(g)
    state = red.state_dict()
    for key in ("ranks", "selection", "momentum"):
        del state[key]
    fresh = GradientReducer(comm, n, "exdyna", 0.02)
    fresh.load_state_dict(state)
    assert_all(comm, np.array_equal(fresh.step(g), red.step(g)), "older state")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_float32_steps_conserve_exactly(comm, algorithm):
    """Every step, in float32 on gradients whose sums are exact (multiples of 1/8): what the
    ranks sent (grad + residual before, minus the residual after) sums to the update, entry
    for entry. The pass zeroed the candidates from its cut rounded up to float32, the
    fix-ups compared with it rounded to nearest: an entry between the two was sent and also
    kept in the residual, to be sent again (7 of 200 steps at n = 100,000 on one rank).
    200 steps on one rank; on more, 400 selections (steps times ranks), in 50 steps or more."""
    n, steps = 100_000, min(200, max(50, -(-400 // comm.size)))
    red = GradientReducer(comm, n, algorithm, 0.01, average=False)
    residual = np.zeros(n, np.float32)
    problems = []
    for t in range(steps):
        rng = np.random.default_rng([comm.rank + 2, t])
        g = (np.round(rng.standard_normal(n) * 8) / 8).astype(np.float32)
        acc = g + residual
        update = red.step(g)
        residual = red.residual.copy()
        sent = comm.allreduce((acc - residual).astype(np.float64))
        bad = np.flatnonzero(sent != update.astype(np.float64))
        if bad.size and len(problems) < 3:
            i = bad[0]
            problems.append(
                f"step {t}: {bad.size} entries, e.g. {i}: sent {sent[i]}, update {update[i]}"
            )
    check_everywhere(comm, problems, [update])


@pytest.mark.parametrize(
    ("algorithm", "saved_kw", "kw", "match"),
    [
        ("oktopk", {}, {"tau": 8}, "options={'tau': 32}"),
        ("exdyna", {"tolerance": 0.2}, {}, "options={'tolerance': 0.2}"),
        ("auto", {"tries": 1}, {"alpha": 1e-3, "tries": 1}, "options={'alpha': None"),
        ("allgather", {"selection_options": {"interval": 4}}, {}, "selection_options="),
    ],
)
def test_checkpoint_rejects_other_algorithm_options(comm, algorithm, saved_kw, kw, match):
    """A state saved with other algorithm options (or selection options) is refused, naming
    them: before, loading wrote the saved instance's attributes, options included, over the
    reducer's, which went on with the saved options (oktopk built with tau=8 ran tau=32).
    An option given at its default is the same reducer: its state loads and goes on alike."""
    n = 600
    g = [np.random.default_rng([2, comm.rank, t]).standard_normal(n) for t in range(4)]
    if algorithm == "allgather":
        saved_kw, kw = {**saved_kw, "selection": "reuse"}, {**kw, "selection": "reuse"}
    red = GradientReducer(comm, n, algorithm, 0.05, **saved_kw)
    red.step(g[0])
    other = GradientReducer(comm, n, algorithm, 0.05, **kw)
    with pytest.raises(ValueError, match=re.escape(match)):
        other.load_state_dict(red.state_dict())
    assert other.steps == 0 and other.residual is None
    # the defaults spelled out: taken
    same = GradientReducer(comm, n, algorithm, 0.05, **saved_kw)
    # (oktopk's band as a list: the same values as the default tuple)
    default = {
        "oktopk": {"tau": 32, "band": [0.8, 1.25]},
        "exdyna": {"rule": "window"},
        "auto": {"alpha": None},
    }
    explicit = GradientReducer(
        comm, n, algorithm, 0.05, **{**saved_kw, **default.get(algorithm, {})}
    )
    same.load_state_dict(red.state_dict())
    explicit.load_state_dict(red.state_dict())
    problems = []
    for t in range(1, 4):
        want = red.step(g[t])
        if not (
            np.array_equal(same.step(g[t]), want) and np.array_equal(explicit.step(g[t]), want)
        ):
            problems.append(f"step {t} after restore differs")
    check_everywhere(comm, problems, [want])
