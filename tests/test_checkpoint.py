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
