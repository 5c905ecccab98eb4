"""The algorithm registry: names, duplicates, unknown names, every subclass registered."""

from __future__ import annotations

import pytest

import sparsecoll
from sparsecoll import Algorithm, register_algorithm
from sparsecoll.registry import _REGISTRY, algorithm_class


def test_builtins_registered():
    names = sparsecoll.available_algorithms()
    for required in ("allgather", "dense", "rabenseifner"):
        assert required in names
    assert names == sorted(names)


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_algorithm_subclass_is_registered():
    sparsecoll.available_algorithms()
    registered = set(_REGISTRY.values())
    for sub in _subclasses(Algorithm):
        if sub.__module__.startswith("sparsecoll.algorithms"):
            assert sub in registered, f"{sub.__qualname__} is not registered"
            assert algorithm_class(sub.name) is sub


def test_duplicate_name_is_an_error():
    class Again(Algorithm):
        name = "allgather"

        def reduce(self, comm, x):
            return x

    with pytest.raises(sparsecoll.AlgorithmExistsError, match="already registered"):
        register_algorithm(Again)


def test_register_and_use_a_new_name():
    class Mine(Algorithm):
        name = "test-mine"

        def reduce(self, comm, x):
            return x

    try:
        register_algorithm(Mine)
        assert "test-mine" in sparsecoll.available_algorithms()
        assert isinstance(sparsecoll.get_algorithm("test-mine"), Mine)
    finally:
        _REGISTRY.pop("test-mine", None)


def test_unknown_name_lists_known():
    with pytest.raises(sparsecoll.UnknownAlgorithmError, match="known: .*allgather.*dense"):
        sparsecoll.get_algorithm("nope")
    with pytest.raises(ValueError):  # a ValueError, as numpy users expect
        sparsecoll.get_algorithm("nope")


def test_unexpected_option_is_a_type_error():
    with pytest.raises(TypeError, match="takes no options"):
        sparsecoll.get_algorithm("allgather", k=3)


def test_not_an_algorithm():
    with pytest.raises(TypeError, match="Algorithm subclass"):
        register_algorithm(int)
