"""The by-name warning (sparsecoll._byname) on one process: when it warns, and once."""

from __future__ import annotations

import warnings

import pytest

import sparsecoll
from sparsecoll import _byname


@pytest.fixture(autouse=True)
def _fresh():
    _byname.forget()
    yield
    _byname.forget()


def _said(algo, options, n) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _byname.note_named_call(algo, options, n)
    return [str(w.message) for w in caught]


def test_a_repeat_warns_once_per_algorithm() -> None:
    ok = sparsecoll.get_algorithm("oktopk", k=5, tau=3)
    assert _said(ok, {"k": 5, "tau": 3}, 100) == []
    (said,) = _said(ok, {"tau": 3, "k": 5}, 100)  # (the options' order does not matter)
    assert "algo = sparsecoll.get_algorithm('oktopk', k=5, tau=3)" in said
    assert _said(ok, {"k": 5, "tau": 3}, 100) == []  # once
    ex = sparsecoll.get_algorithm("exdyna", k=5)
    assert _said(ex, {"k": 5}, 100) == []
    assert len(_said(ex, {"k": 5}, 100)) == 1  # once per algorithm


def test_no_warning_without_state_or_repeat() -> None:
    for name in ("dsa", "auto", "gtopk"):
        algo = sparsecoll.get_algorithm(name, **({"k": 5} if name == "gtopk" else {}))
        assert _said(algo, {}, 100) + _said(algo, {}, 100) == [], name
    ok = sparsecoll.get_algorithm("oktopk", k=5)
    assert _said(ok, {"k": 5}, 100) + _said(ok, {"k": 5}, 101) + _said(ok, {"k": 6}, 100) == []


def test_only_recent_calls_are_remembered() -> None:
    ok = sparsecoll.get_algorithm("oktopk", k=5)
    for n in range(_byname.REMEMBERED + 1):
        assert _said(ok, {"k": 5}, n) == []
    assert _said(ok, {"k": 5}, 0) == []  # (forgotten: the oldest)
    assert len(_said(ok, {"k": 5}, _byname.REMEMBERED)) == 1
