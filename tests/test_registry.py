"""The algorithm registry: names, duplicates, unknown names, every subclass registered."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest

import sparsecoll
from sparsecoll import Algorithm, register_algorithm
from sparsecoll.registry import _REGISTRY, algorithm_class, algorithm_options, describe_algorithms


def test_builtins_registered():
    names = sparsecoll.available_algorithms()
    for required in ("allgather", "dense", "rabenseifner"):
        assert required in names
    assert names == sorted(names)


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_algorithm_subclass_is_registered_and_in_the_table():
    """Every Algorithm subclass of sparsecoll.algorithms (each module imported) is registered
    under its name, and the registry's table of built-ins names exactly those classes."""
    import importlib
    import pkgutil

    from sparsecoll import algorithms
    from sparsecoll.registry import BUILTINS

    for info in pkgutil.iter_modules(algorithms.__path__):
        importlib.import_module(f"{algorithms.__name__}.{info.name}")
    builtin = {
        sub.name: f"{sub.__module__}:{sub.__qualname__}"
        for sub in _subclasses(Algorithm)
        if sub.__module__.startswith("sparsecoll.algorithms")
    }
    assert builtin == BUILTINS
    for name, spelled in BUILTINS.items():
        cls = algorithm_class(name)
        assert f"{cls.__module__}:{cls.__qualname__}" == spelled
        assert _REGISTRY[name] is cls
    assert set(BUILTINS) <= set(sparsecoll.available_algorithms())


def test_the_registry_imports_no_algorithm():
    """The registry is a leaf: importing it imports no algorithm module, and a lookup
    imports only the algorithm asked for (a fresh interpreter)."""
    code = (
        "import sys\n"
        "import sparsecoll.registry as r\n"
        "loaded = lambda: sorted(m for m in sys.modules if m.startswith('sparsecoll.algorithms.')"
        " and m.rsplit('.', 1)[1] in r.BUILTINS)\n"
        "before = loaded()\n"
        "r.get_algorithm('dense')\n"
        "print(before, loaded())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = out.stdout.strip().split("] [")
    assert "dense" in after and "oktopk" not in after and "exdyna" not in after, out.stdout
    assert "dense" not in before, out.stdout


@pytest.mark.parametrize("name", ["allgather", "exdyna"])
def test_duplicate_name_is_an_error(name):
    """A built-in's name is taken whether or not its module was imported yet."""

    class Again(Algorithm):
        def reduce(self, comm, x):
            return x

    Again.name = name
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


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("oktop", "oktopk"),
        ("Allgather", "allgather"),
        ("all_gather", "allgather"),
        ("recursive-doubling", "recursive_doubling"),
        ("exdina", "exdyna"),
        ("rabenseifer", "rabenseifner"),
    ],
)
def test_misspelled_name_suggests_the_close_one(typed, meant):
    with pytest.raises(
        sparsecoll.UnknownAlgorithmError,
        match=rf"unknown algorithm '{typed}' \(did you mean '{meant}'\?\); known: allgather",
    ):
        sparsecoll.get_algorithm(typed)


def test_a_name_close_to_none_suggests_nothing():
    with pytest.raises(sparsecoll.UnknownAlgorithmError) as err:
        sparsecoll.get_algorithm("xyzzy")
    assert "did you mean" not in str(err.value)


def test_misspelled_option_suggests_the_close_one():
    with pytest.raises(TypeError, match=r"got tua \(did you mean 'tau'\?\)"):
        sparsecoll.get_algorithm("oktopk", k=3, tua=4)
    with pytest.raises(TypeError, match=r"got K \(did you mean 'k'\?\)"):
        sparsecoll.get_algorithm("gtopk", K=3)
    # density is the reducer's option; the algorithms take a count
    with pytest.raises(TypeError, match=r"got density \(k is a count of entries"):
        sparsecoll.get_algorithm("gtopk", density=0.01)
    with pytest.raises(TypeError) as err:
        sparsecoll.get_algorithm("dense", density=0.01)
    assert str(err.value) == "algorithm 'dense' takes no options, got density"


def test_unexpected_option_is_a_type_error():
    with pytest.raises(TypeError, match="takes no options"):
        sparsecoll.get_algorithm("rabenseifner", k=3)


def test_not_an_algorithm():
    with pytest.raises(TypeError, match="Algorithm subclass"):
        register_algorithm(int)


@pytest.mark.parametrize("name", [["allgather"], 5, None, b"allgather"])
def test_a_name_that_is_not_a_str_is_a_type_error(name):
    with pytest.raises(TypeError, match="must be a name"):
        sparsecoll.get_algorithm(name)


def test_registering_under_a_name_that_is_not_a_str_is_a_type_error():
    class Unnamed(Algorithm):
        def reduce(self, comm, x):
            return x

    with pytest.raises(TypeError, match="name must be a str, got int"):
        register_algorithm(Unnamed, name=5)
    assert 5 not in _REGISTRY


def test_every_option_and_default_is_documented():
    """describe_algorithms() lists each algorithm's options, read from the constructors,
    with their defaults; get_algorithm's docstring points to it."""
    assert "describe_algorithms" in sparsecoll.get_algorithm.__doc__
    listing = describe_algorithms()
    for name in sparsecoll.available_algorithms():
        cls = algorithm_class(name)
        params = [p for p in inspect.signature(cls).parameters.values()]
        assert list(algorithm_options(name)) == [p.name for p in params]
        kind = "exact" if cls.exact else "selecting"
        for text in (listing,):
            if not params:
                assert f"{name} ({kind}): no options" in text
            for p in params:
                shown = "required" if p.name in cls.required else repr(p.default)
                assert f"{p.name}={shown}" in text, (name, p.name)
    assert algorithm_options("oktopk")["tau"][0] == 32
    for name in ("gtopk", "oktopk", "exdyna"):  # (None in the signature: k= is refused)
        assert algorithm_options(name)["k"][0] is inspect.Parameter.empty
        with pytest.raises(TypeError, match="needs k="):
            sparsecoll.get_algorithm(name)
    assert "recompute the global threshold" in algorithm_options("oktopk")["tau"][1]


def test_exact_algorithms_take_only_what_they_accept():
    for name in sparsecoll.available_algorithms():
        cls = algorithm_class(name)
        kinds = {p.kind for p in inspect.signature(cls).parameters.values()}
        assert inspect.Parameter.VAR_KEYWORD not in kinds, f"{name} advertises **options"
    for name in ("allgather", "dsa", "recursive_doubling", "ring"):
        assert list(algorithm_options(name)) == ["wire"]
        assert algorithm_options(name)["wire"][0] == "raw"
    assert list(algorithm_options("hashed")) == ["seed", "wire"]
    for name in ("dense", "rabenseifner"):
        assert algorithm_options(name) == {}
        with pytest.raises(TypeError, match=f"algorithm '{name}' takes no options, got x"):
            sparsecoll.get_algorithm(name, x=1)


def test_unknown_option_names_the_accepted_ones():
    with pytest.raises(TypeError, match="'oktopk' takes k, tau, tau_prime, .*got kk"):
        sparsecoll.get_algorithm("oktopk", kk=3)


def test_auto_options_are_the_cost_model_constants():
    from sparsecoll.algorithms.auto import CostModel

    opts = algorithm_options("auto")
    assert opts.pop("calibrate")[0] is False
    assert (opts.pop("tries")[0], opts.pop("spread")[0]) == (5, 2.5)  # (the measured contenders)
    assert opts.pop("alpha")[0] is None and opts.pop("beta")[0] is None  # (measured)
    model = dataclasses.asdict(CostModel())
    del model["alpha"], model["beta"]
    assert {k: v[0] for k, v in opts.items()} == model


def test_dir_shows_only_the_api_and_submodules():
    extra = [
        n
        for n in dir(sparsecoll)
        if not n.startswith("_")
        and n not in sparsecoll.__all__
        and not isinstance(getattr(sparsecoll, n), types.ModuleType)
    ]
    assert extra == []
    assert "annotations" not in dir(sparsecoll)


def test_docs_list_the_options_as_the_code_does():
    """docs/guide/api.md carries the output of ``python -m sparsecoll algorithms``; rerun it
    into the block after the ``algorithms-listing`` marker when an option changes."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "guide" / "api.md").read_text()
    block = text.split("<!-- algorithms-listing", 1)[1].split("```text\n", 1)[1]
    assert block.split("```", 1)[0] == describe_algorithms()


def test_a_plugin_that_fails_to_load_leaves_the_others_and_names_itself(tmp_path, monkeypatch):
    """Entry points of the group sparsecoll.algorithms: one whose module is missing (or
    raises on import) is not available, and asking for it says why; a plugin listed after
    it and every built-in load as usual, on the first call as on later ones."""
    from importlib.metadata import EntryPoint

    from sparsecoll import registry

    (tmp_path / "plugin_ok.py").write_text(
        "from sparsecoll.registry import algorithm_class\n"
        "class Good(algorithm_class('allgather')):\n"
        "    name = 'plugin-good'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    group = "sparsecoll.algorithms"
    eps = [
        EntryPoint("plugin-broken", "plugin_missing_module:Algo", group),
        EntryPoint("plugin-good", "plugin_ok:Good", group),
    ]
    monkeypatch.setattr(registry, "entry_points", lambda group: eps)
    _fresh_registry(monkeypatch)
    for _ in range(2):  # (the first call raised the plugin's error, later ones forgot it)
        names = sparsecoll.available_algorithms()
        assert "plugin-good" in names
        assert "allgather" in names
        assert "plugin-broken" not in names
        assert type(sparsecoll.get_algorithm("allgather")).name == "allgather"
        assert type(sparsecoll.get_algorithm("plugin-good")).name == "plugin-good"
        with pytest.raises(ImportError, match="plugin_missing_module") as err:
            sparsecoll.get_algorithm("plugin-broken")
        assert str(err.value).startswith(
            "algorithm 'plugin-broken' could not be loaded from its entry point "
            "'plugin_missing_module:Algo' (group sparsecoll.algorithms): ModuleNotFoundError"
        )
    assert "algorithm 'plugin-broken' could not be loaded" in describe_algorithms()


def _fresh_registry(monkeypatch):
    """The registry as before its first lookup (the built-ins and what the tests registered
    kept), restored after the test."""
    from sparsecoll import registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_BROKEN", {})
    monkeypatch.setattr(registry, "_SHADOWED", [], raising=False)
    monkeypatch.setattr(registry, "_loaded", False)


def test_a_plugin_named_like_a_registered_algorithm_is_listed_as_not_loaded(tmp_path, monkeypatch):
    """An entry point named like a built-in, or like an earlier entry point, is not loaded
    (the name stays the first one's), and ``python -m sparsecoll algorithms`` says so, as it
    lists a plugin that failed to load. Both were skipped without a word. The same entry
    point listed twice, or naming the class its module registered already, is no clash."""
    from importlib.metadata import EntryPoint

    from sparsecoll import registry

    (tmp_path / "plugin_clash.py").write_text(
        "from sparsecoll.registry import algorithm_class, register_algorithm\n"
        "class Mine(algorithm_class('allgather')):\n"
        "    name = 'plugin-mine'\n"
        "class Other(Mine):\n"
        "    pass\n"
        "@register_algorithm\n"
        "class Itself(Mine):\n"
        "    name = 'plugin-itself'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    _fresh_registry(monkeypatch)
    import plugin_clash  # (registers plugin-itself, as a plugin module imported early may)

    group = "sparsecoll.algorithms"
    eps = [
        EntryPoint("oktopk", "plugin_clash:Mine", group),
        EntryPoint("plugin-mine", "plugin_clash:Mine", group),
        EntryPoint("plugin-mine", "plugin_clash:Mine", group),
        EntryPoint("plugin-mine", "plugin_clash:Other", group),
        EntryPoint("plugin-itself", "plugin_clash:Itself", group),
    ]
    monkeypatch.setattr(registry, "entry_points", lambda group: eps)
    monkeypatch.setattr(registry, "_loaded", False)
    assert type(sparsecoll.get_algorithm("oktopk", k=1)).__name__ == "OkTopk"
    assert type(sparsecoll.get_algorithm("plugin-mine")) is plugin_clash.Mine
    assert type(sparsecoll.get_algorithm("plugin-itself")) is plugin_clash.Itself
    listing = describe_algorithms()
    left_out = listing[len(textwrap.dedent(registry._options_doc())) :]
    assert left_out == (
        "\n    algorithm 'oktopk' was not loaded from its entry point 'plugin_clash:Mine' "
        "(group sparsecoll.algorithms): the name is taken by the built-in algorithm "
        "sparsecoll.algorithms.oktopk.OkTopk; give the plugin another name\n"
        "\n    algorithm 'plugin-mine' was not loaded from its entry point "
        "'plugin_clash:Other' (group sparsecoll.algorithms): the name is taken by the entry "
        "point 'plugin_clash:Mine', listed before it; give the plugin another name\n"
    )


@pytest.mark.parametrize("returned", [None, (np.array([0]), np.array([1.0]))])
def test_a_user_algorithm_returning_no_sparse_vector_is_named(returned, monkeypatch):
    """A registered algorithm whose reduce() returns something else than a SparseVector:
    allreduce and a GradientReducer's sparse step name it and what it must return (they
    raised AttributeError "'NoneType' object has no attribute 'info'" / "... 'contributed'")."""
    from mpi4py import MPI

    from sparsecoll import registry

    class Careless(Algorithm):
        name = "test-careless"

        def reduce(self, comm, x):
            return returned

    what = r"Careless\.reduce\(\) must return a SparseVector, got (NoneType|tuple)"
    with pytest.raises(TypeError, match=what):
        sparsecoll.allreduce(MPI.COMM_SELF, [1.0], [0], n=2, algorithm=Careless())
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    register_algorithm(Careless)
    red = sparsecoll.GradientReducer(MPI.COMM_SELF, 4, "test-careless", 0.5)
    with pytest.raises(TypeError, match=what):
        red.step(np.array([1.0, -3.0, 2.0, 0.5]))
