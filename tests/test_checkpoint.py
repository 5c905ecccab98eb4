"""GradientReducer checkpoints in-process (MPI.COMM_SELF): which constructor arguments a saved
state must agree with, which may change on resume, and states that are not a whole
state_dict(). The collective paths (every rank, the DDP hook's state) are in
tests/mpi/test_reducer.py."""

from __future__ import annotations

import pickle
import re

import numpy as np
import pytest
from mpi4py import MPI

from sparsecoll import GradientReducer

N = 400


def grads(steps: int, seed: int = 0) -> list[np.ndarray]:
    return [np.random.default_rng([seed, t]).standard_t(2, N) for t in range(steps)]


def reducer(algorithm: str = "allgather", **kw) -> GradientReducer:
    return GradientReducer(MPI.COMM_SELF, N, algorithm, 0.05, **kw)


def saved(red: GradientReducer) -> dict:
    return pickle.loads(pickle.dumps(red.state_dict()))


def unchanged(red: GradientReducer, steps: int, residual: np.ndarray | None) -> bool:
    now = red.residual
    same = residual is None if now is None else np.array_equal(now, residual)
    return red.steps == steps and same


@pytest.mark.parametrize(
    ("saved_kw", "kw", "match"),
    [
        ({}, {"error_feedback": False}, "error_feedback=True, this reducer has False"),
        ({"error_feedback": False}, {}, "error_feedback=False, this reducer has True"),
        ({"average": False}, {}, "average=False, this reducer has True"),
        ({}, {"average": False}, "average=True, this reducer has False"),
    ],
)
@pytest.mark.parametrize("algorithm", ["allgather", "oktopk", "exdyna"])
def test_state_of_another_meaning_is_refused(algorithm, saved_kw, kw, match):
    """A state saved with error feedback on, loaded into a reducer with it off (its memory
    dropped), or the reverse (what the last step dropped added to the next), or with another
    ``average`` (updates P times larger or smaller) is refused, naming the argument and both
    values; the reducer is left as it was. Before, each loaded silently."""
    g = grads(3)
    red = reducer(algorithm, **saved_kw)
    red.step(g[0])
    other = reducer(algorithm, **kw)
    other.step(g[1])
    before = other.residual.copy()
    with pytest.raises(ValueError, match=re.escape(match)):
        other.load_state_dict(saved(red))
    assert unchanged(other, 1, before)


def test_warmup_may_change_the_saved_step_counter_decides():
    """``warmup`` is a schedule over the step counter, which the state holds: a longer warm-up
    on resume makes the steps before it dense, a shorter one makes the next step sparse as
    in a run built with it. The state loads either way."""
    g = grads(6)
    # saved past a warm-up of 1, resumed with warmup=4: steps 2 and 3 are dense
    red = reducer(warmup=1)
    for t in range(2):
        red.step(g[t])
    longer = reducer(warmup=4)
    longer.load_state_dict(saved(red))
    acc = g[2] + red.residual
    assert np.array_equal(longer.step(g[2]), acc), "a step in the longer warm-up is dense"
    assert longer.stats()["achieved_density"] == 1.0
    longer.step(g[3])
    longer.step(g[4])
    assert longer.stats()["achieved_density"] <= 0.05, "sparse once the warm-up is over"
    # saved in a warm-up of 3 (after one step), resumed with warmup=1: as a run with warmup=1
    red = reducer(warmup=3)
    red.step(g[0])
    shorter = reducer(warmup=1)
    shorter.load_state_dict(saved(red))
    twin = reducer(warmup=1)
    twin.step(g[0])
    for t in range(1, 6):
        assert np.array_equal(shorter.step(g[t]), twin.step(g[t])), f"step {t}"


@pytest.mark.parametrize("kw", [{"reuse_update": True}, {"check": False}])
@pytest.mark.parametrize("algorithm", ["allgather", "oktopk"])
def test_implementation_choices_may_change(algorithm, kw):
    """``reuse_update`` and ``check`` change how a step runs, not what the state means: a
    state saved without them loads into a reducer with them and goes on bit for bit."""
    g = grads(6)
    red = reducer(algorithm)
    for t in range(3):
        red.step(g[t])
    other = reducer(algorithm, **kw)
    other.load_state_dict(saved(red))
    for t in range(3, 6):
        assert np.array_equal(other.step(g[t]), red.step(g[t])), f"step {t}"


def test_state_saved_before_the_arguments_were_recorded_loads():
    """A state without ``error_feedback``, ``average`` or ``rank`` (an earlier sparsecoll's)
    cannot say what it was saved with: it is taken as saved with this reducer's arguments,
    as every earlier version did, and goes on alike."""
    g = grads(5)
    red = reducer("oktopk")
    for t in range(2):
        red.step(g[t])
    state = saved(red)
    for key in ("error_feedback", "average", "rank"):
        del state[key]
    fresh = reducer("oktopk")
    fresh.load_state_dict(state)
    for t in range(2, 5):
        assert np.array_equal(fresh.step(g[t]), red.step(g[t])), f"step {t}"


def _without(key):
    def edit(state):
        del state[key]

    return edit


def _set(key, value):
    def edit(state):
        state[key] = value(state) if callable(value) else value

    return edit


MALFORMED = {
    # (a later sparsecoll's statistics field: CommStats refused it after steps were loaded)
    "unknown totals field": (_set("totals", lambda s: {**s["totals"], "new": 1}), "totals"),
    "no totals": (_without("totals"), "state lacks totals"),
    "no residual": (_without("residual"), "state lacks residual"),
    "residual too short": (_set("residual", np.zeros(N - 1)), f"n={N} float16"),
    "integer residual": (_set("residual", np.zeros(N, np.int64)), "got 400 of int64"),
    "NaN in the residual": (
        _set("residual", lambda s: np.where(np.arange(N) == 3, np.nan, s["residual"])),
        "residual holds NaN or Inf",
    ),
    "algorithm state not a dict": (_set("algorithm_state", None), "algorithm_state must be"),
    "no format version": (_without("version"), "state holds no format version"),
    "a later format": (_set("version", 2), "format version 2, this sparsecoll reads version 1"),
    "negative steps": (_set("steps", -1), "steps must be an integer >= 0"),
    "float steps": (_set("steps", 2.5), "steps must be an integer >= 0"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_state_it_cannot_take_changes_nothing(case):
    """A state with a key missing, of a later key set, or with entries of the wrong kind is
    refused (ValueError or TypeError naming the entry) and the reducer is left as it was.
    Before, the checks ran one by one while loading: an unknown statistics field or a bad
    algorithm state raised after the step counter and the residual were replaced (the
    reducer half-loaded), a missing key was a bare KeyError, and a residual of another
    length, of integers or holding NaN loaded, after which every step failed."""
    edit, match = MALFORMED[case]
    g = grads(5)
    red, twin = reducer("oktopk"), reducer("oktopk")
    for t in range(2):
        red.step(g[t])
        twin.step(g[t])
    state = saved(reducer("oktopk"))  # (a fresh reducer's: its residual is None)
    state["residual"] = np.ones(N)
    edit(state)
    before = red.residual.copy()
    with pytest.raises((ValueError, TypeError), match=re.escape(match)):
        red.load_state_dict(state)
    assert unchanged(red, 2, before)
    for t in range(2, 5):
        assert np.array_equal(red.step(g[t]), twin.step(g[t])), f"step {t} after the refusal"


@pytest.mark.parametrize("state", [None, [("steps", 1)], "state"])
def test_state_that_is_no_dict_is_a_type_error(state):
    red = reducer()
    with pytest.raises(TypeError, match="state must be a dict from state_dict()"):
        red.load_state_dict(state)


def test_old_state_without_momentum_into_a_momentum_reducer_is_refused():
    """A state saved before momentum was recorded says it had none when it holds no velocity
    after a step (with momentum, every step leaves one): unambiguous, so it is refused by a
    reducer with momentum, as a state recording momentum=0.0 is. Before, it loaded and the
    reducer went on from a zero velocity."""
    red = reducer()
    red.step(grads(1)[0])
    state = saved(red)
    del state["momentum"]
    with pytest.raises(ValueError, match=r"no momentum-correction velocity after 1 steps"):
        reducer(momentum=0.9).load_state_dict(state)
    before = saved(reducer())  # (no step yet: nothing says what it was saved with)
    del before["momentum"]
    reducer(momentum=0.9).load_state_dict(before)


def test_residual_as_a_torch_tensor_loads():
    """A state whose residual and velocity were made torch tensors loads, and the run goes
    on bit for bit."""
    torch = pytest.importorskip("torch")
    g = grads(5)
    red = reducer("oktopk", momentum=0.5)
    for t in range(2):
        red.step(g[t])
    state = saved(red)
    for key in ("residual", "velocity"):
        state[key] = torch.from_numpy(state[key])
    other = reducer("oktopk", momentum=0.5)
    other.load_state_dict(state)
    for t in range(2, 5):
        assert np.array_equal(other.step(g[t]), red.step(g[t])), f"step {t}"


def test_residual_and_velocity_of_different_dtypes_are_refused():
    """A state_dict() holds the residual and the velocity in its gradients' dtype: a state
    whose velocity is float32 beside a float64 residual is refused, naming both (before, it
    loaded, and float64 steps took the velocity widened, float32 steps were refused)."""
    red = reducer(momentum=0.5)
    red.step(grads(1)[0])
    state = saved(red)
    state["velocity"] = state["velocity"].astype(np.float32)
    other = reducer(momentum=0.5)
    with pytest.raises(ValueError, match="residual is float64, its velocity float32"):
        other.load_state_dict(state)
    assert unchanged(other, 0, None)


def _bounds_as(form):
    def edit(bounds):
        if form == "read-only":
            bounds = bounds.copy()
            bounds.flags.writeable = False
        elif form == "strided":
            bounds = np.repeat(bounds, 2)[::2]
        elif form == "byte-swapped":
            bounds = bounds.astype(bounds.dtype.newbyteorder())
        elif form == "int32":
            bounds = bounds.astype(np.int32)
        else:  # "list"
            bounds = bounds.tolist()
        return bounds

    return edit


@pytest.mark.parametrize("form", ["read-only", "strided", "byte-swapped", "int32", "list"])
@pytest.mark.parametrize(("algorithm", "key"), [("oktopk", "boundaries"), ("exdyna", "bounds")])
def test_saved_bounds_of_any_array_form_go_on_alike(algorithm, key, form):
    """The algorithm's region or partition bounds as another tool may have left them
    (read-only, strided, in the other byte order, as int32 or as a list) are restored as a
    new native int64 array, and the run goes on bit for bit. Before, they were restored
    as they came: oktopk's bounds as a list failed at every step (no .max()), the others
    ran on an array of another kind than the algorithm made."""
    g = grads(7)
    red = reducer(algorithm)
    for t in range(3):
        red.step(g[t])
    state = saved(red)
    state["algorithm_state"][key] = _bounds_as(form)(state["algorithm_state"][key])
    other = reducer(algorithm)
    other.load_state_dict(state)
    got = getattr(other.algorithm, key)
    assert isinstance(got, np.ndarray) and got.dtype == np.int64 and got.flags.writeable
    for t in range(3, 7):
        assert np.array_equal(other.step(g[t]), red.step(g[t])), f"step {t}"


def _same_state(a, b) -> bool:
    """Whether two state_dict()s hold the same values (arrays by dtype and content)."""
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
        )
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    if isinstance(a, np.random.Generator):  # (a sampler's: where its draws go on from)
        return isinstance(b, np.random.Generator) and _same_state(
            a.bit_generator.state, b.bit_generator.state
        )
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("n", [N, 5000])
@pytest.mark.parametrize(
    ("algorithm", "selection"),
    [
        ("oktopk", "reuse"),
        ("exdyna", "exact"),
        ("gtopk", "reuse"),
        ("auto", "reuse"),
        ("allgather", "exact"),
        ("allgather", "sampling"),
        ("allgather", "gaussian"),
    ],
)
def test_every_state_saved_loads_back_and_saves_the_same(algorithm, selection, n):
    """A state saved at any step (before the first, in the run, after reset()) loads into a
    new reducer, which saves the same state, steps as the saved reducer and saves the same
    state again: what state_dict() writes is what the checks of load_state_dict() take
    (exdyna's partitions for n below and above its block count, oktopk's regions, each
    selection's state, the exact top-k's predicted cut)."""
    g = [np.random.default_rng([3, t]).standard_normal(n).astype(np.float32) for t in range(6)]
    options = {"momentum": 0.5, "selection": selection}
    if selection == "sampling":  # (a sample smaller than n: the generator's draws matter)
        options["selection_options"] = {"min_sample": 64}

    def build():
        return GradientReducer(MPI.COMM_SELF, n, algorithm, 0.05, **options)

    red = build()
    for t in range(6):
        if t == 4:
            red.reset()
        state = saved(red)
        other = build()
        other.load_state_dict(state)
        assert _same_state(saved(other), state), f"state at step {t} loaded back"
        assert np.array_equal(other.step(g[t]), red.step(g[t])), f"step {t}"
        assert _same_state(saved(other), saved(red)), f"state after step {t}"


def test_algorithm_state_of_another_version_is_refused(monkeypatch):
    """An algorithm state saved before its class raised ``state_version`` (an attribute that
    kept its name but changed its meaning) is refused, naming both versions; a state saved
    before states were versioned is version 1. The DDP hook's state saved at another
    density loads whatever its algorithm state's version: that state is replaced by a fresh
    reducer's, as for any change of density."""
    from sparsecoll.algorithms.oktopk import OkTopk
    from sparsecoll.integrations.torch import SparseHookState

    g = grads(1)[0]
    red = reducer("oktopk")
    red.step(g)
    state = saved(red)
    hook = SparseHookState(MPI.COMM_SELF, "oktopk", density=0.05)
    hook.reducer(0, N, "torch.float32").step(g.astype(np.float32))
    hooked = pickle.loads(pickle.dumps(hook.state_dict()))
    monkeypatch.setattr(OkTopk, "state_version", 2)
    fresh = reducer("oktopk")
    with pytest.raises(ValueError, match="oktopk's state version 1, this sparsecoll's oktopk"):
        fresh.load_state_dict(state)
    assert unchanged(fresh, 0, None)
    denser = SparseHookState(MPI.COMM_SELF, "oktopk", density=0.1)
    denser.load_state_dict(hooked)
    got = denser.reducer(0, N, "torch.float32")
    assert got.k == 40 and got.steps == 1
    monkeypatch.setattr(OkTopk, "state_version", 1)
    del state["algorithm_version"]
    fresh.load_state_dict(state)
    assert np.array_equal(fresh.step(g), red.step(g))


def _selection_edit(case):
    """A reuse selection's saved state edited as the ``case`` of
    test_selection_state_it_cannot_take_is_refused says."""

    def edit(state):
        sel = state["selection_state"]
        if case == "interval, options unrecorded":
            sel["interval"] = 4
            del state["selection_options"]
        elif case == "threshold of text":
            sel["_t"] = "x"
        elif case == "threshold NaN":
            sel["_t"] = float("nan")
        elif case == "step a float":
            sel["step"] = 2.0
        elif case == "slot missing":
            del sel["recomputes"]
        else:  # "newer version"
            state["selection_version"] = 2

    return edit


SELECTION_CASES = {
    "interval, options unrecorded": (ValueError, "has interval=4, this reducer's reuse has 32"),
    "threshold of text": (TypeError, "reuse's _t must be a real number, got str"),
    "threshold NaN": (ValueError, "reuse's _t must be a number > 0, got nan"),
    "step a float": (TypeError, "reuse's step must be an integer, got float"),
    "slot missing": (ValueError, "selection_state lacks recomputes: not the state of"),
    "newer version": (ValueError, "reuse's state version 2, this sparsecoll's reuse reads"),
}


@pytest.mark.parametrize("case", list(SELECTION_CASES))
def test_selection_state_it_cannot_take_is_refused(case):
    """The selection estimator's saved state is checked as the algorithm's is: its options
    equal to the reducer's (not written over it), each state slot of its kind, every slot
    there, its version; the reducer is left as it was, and then loads its own state.
    Before, the slots were written over the estimator as they came: interval=4 ran with
    4 where the state lacked selection_options, a threshold of text loaded and then failed
    at every step, a missing slot kept its fresh value beside the saved others."""
    g = grads(6)
    kw = {"selection": "reuse"}
    red = reducer(**kw)
    for t in range(3):
        red.step(g[t])
    state = saved(red)
    _selection_edit(case)(state)
    fresh = reducer(**kw)
    etype, match = SELECTION_CASES[case]
    with pytest.raises(etype, match=re.escape(match)):
        fresh.load_state_dict(state)
    assert unchanged(fresh, 0, None) and fresh._selector.step == 0
    assert fresh._selector.interval == 32
    fresh.load_state_dict(saved(red))
    for t in range(3, 6):
        assert np.array_equal(fresh.step(g[t]), red.step(g[t])), f"step {t}"


def test_restored_run_predicts_the_exact_top_k_cut_as_the_saved_one():
    """The exact top-k's predicted candidate cut is saved (five numbers), so a restored run
    reads x in full no more often than the saved run goes on to: its full_topk_steps rise
    alike, and its updates are the same. Before, the first step after a restore had no
    prediction and made one more full top-k read."""
    g = [np.random.default_rng([5, t]).standard_normal(5000) for t in range(8)]
    red = GradientReducer(MPI.COMM_SELF, 5000, "allgather", 0.01)
    for t in range(4):
        red.step(g[t])
    before = red.stats()["full_topk_steps"]
    other = GradientReducer(MPI.COMM_SELF, 5000, "allgather", 0.01)
    other.load_state_dict(saved(red))
    for t in range(4, 8):
        assert np.array_equal(other.step(g[t]), red.step(g[t])), f"step {t}"
    after = red.stats()["full_topk_steps"] - before
    assert other.stats()["full_topk_steps"] == after
    wrong = saved(red)
    wrong["topk_state"]["_slope"] = 0.0
    with pytest.raises(ValueError, match=r"exact top-k's _slope must be a number in \[1.0, 30.0\]"):
        other.load_state_dict(wrong)
