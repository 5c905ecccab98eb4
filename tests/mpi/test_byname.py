"""Calls by name under MPI: a stateful selecting algorithm called again by name warns once
with the fix (one instance for every call), and that instance reuses its threshold; by name,
every call starts anew and meets the contract."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import sparsecoll
from sparsecoll import _byname
from sparsecoll.algorithms.base import reference_sum
from sparsecoll.benchmarks.main import gather_inputs

from .cases import assert_all, digest

N = 5000
K = 50


def _input(rank: int, seed: int = 0):
    rng = np.random.default_rng([seed, rank])
    idx = rng.choice(N, 200, replace=False)
    return rng.standard_normal(200).astype(np.float32), idx


def _calls(comm, count: int, algorithm, **options):
    """``count`` calls on one input; the results and the warnings each call gave."""
    vals, idx = _input(comm.rank)
    outs, said = [], []
    for _ in range(count):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outs.append(sparsecoll.allreduce(comm, vals, idx, n=N, algorithm=algorithm, **options))
        said.append([str(w.message) for w in caught if w.category is UserWarning])
    return outs, said


def _messages(out) -> int:
    s = out.info["stats"]
    return s.messages_sent + s.meta_messages_sent


@pytest.fixture(autouse=True)
def _fresh():
    _byname.forget()
    yield
    _byname.forget()


@pytest.mark.parametrize("name", ["oktopk", "exdyna"])
def test_a_repeat_by_name_warns_once_with_the_fix(comm, name):
    opts = sparsecoll.registry.algorithm_class(name).default_options(N, K)
    outs, said = _calls(comm, 3, name, **opts)
    assert_all(comm, [len(s) for s in said] == [0, 1, 0], f"{name}: warned {said}")
    fix = f"algo = sparsecoll.get_algorithm({name!r}, k={K})"
    assert_all(comm, fix in said[1][0], said[1][0])
    # by name, every call starts anew: the same result each time, meeting the contract
    inputs = gather_inputs(comm, *_input(comm.rank), N)
    algo = sparsecoll.get_algorithm(name, **opts)
    ok = all(algo.verify(out, reference_sum(inputs), inputs) for out in outs)
    assert_all(comm, ok and len({digest(out) for out in outs}) == 1, name)


def test_the_fix_reuses_the_threshold(comm):
    """One instance for every call: the second call reuses the first one's threshold
    (no recompute: fewer messages than the same call by name) and meets the contract."""
    by_name, _ = _calls(comm, 2, "oktopk", k=K)
    reused, said = _calls(comm, 2, sparsecoll.get_algorithm("oktopk", k=K))
    assert_all(comm, said == [[], []], f"an instance warned: {said}")
    first, second = reused
    assert_all(comm, [o.info["recomputed"] for o in by_name] == [True, True], "by name")
    assert_all(comm, (first.info["recomputed"], second.info["recomputed"]) == (True, False))
    assert_all(comm, second.info["step"] == 1 and second.info["kept"] == K, str(second.info))
    if comm.size > 1:
        fewer = _messages(second) < _messages(by_name[1])
        assert_all(comm, fewer, f"{_messages(second)} vs {_messages(by_name[1])} messages")
    inputs = gather_inputs(comm, *_input(comm.rank), N)
    ok = sparsecoll.get_algorithm("oktopk", k=K).verify(second, reference_sum(inputs), inputs)
    assert_all(comm, ok, "the reusing call breaks oktopk's contract")


def test_no_warning_without_state_or_repeat(comm):
    """Exact algorithms, gtopk (no state between calls) and calls with other options or
    another n never warn."""
    vals, idx = _input(comm.rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            sparsecoll.allreduce(comm, vals, idx, n=N, algorithm="dsa")
            sparsecoll.allreduce(comm, vals, idx, n=N, algorithm="gtopk", k=K)
        sparsecoll.allreduce(comm, vals, idx, n=N, algorithm="oktopk", k=K)
        sparsecoll.allreduce(comm, vals, idx, n=N, algorithm="oktopk", k=K + 1)
        sparsecoll.allreduce(comm, vals, idx, n=N + 1, algorithm="oktopk", k=K)
        sparsecoll.allreduce(comm, vals, idx, n=N, algorithm="oktopk", k=K, tau=5)
    said = [str(w.message) for w in caught if w.category is UserWarning]
    assert_all(comm, not said, f"warned: {said}")
