"""Constructor options of every algorithm, estimator, GradientReducer and the DDP hook state:
a wrong type raises TypeError and a wrong value ValueError, each naming the option (float()
and bool() took strings, None and True; a band that was not a pair failed unpacking it)."""

from __future__ import annotations

import math
import numbers

import pytest
from mpi4py import MPI

from sparsecoll import GradientReducer, get_algorithm, select
from sparsecoll.registry import algorithm_class

NOT_REAL = [None, "0.5", True, [1.0]]
NOT_FLAG = [None, "no", 1, 0.0]
NOT_BAND = [None, "x", 1.0, [1.0], (0.8, "2"), (0.8, None), (1.5, 2.0), (0.5, 0.9), (math.nan, 2)]
NOT_INT = [None, "3", True, 1.5, math.nan, [3]]


def _algo(name, **base):
    def build(**kw):
        return get_algorithm(name, **base, **kw)

    build.__name__ = name
    return build


def _reducer(**kw):
    return GradientReducer(MPI.COMM_WORLD, 16, "oktopk", **kw)


def _hook_state(**kw):
    pytest.importorskip("torch")
    from sparsecoll.integrations.torch import SparseHookState

    return SparseHookState(MPI.COMM_WORLD, "oktopk", **kw)


OKTOPK, EXDYNA = _algo("oktopk", k=4), _algo("exdyna", k=4)
REUSE, SAMPLING = select.ReuseThreshold, select.SamplingThreshold
CASES = [
    # (build, option, bad values, extra options)
    (OKTOPK, "nudge", [*NOT_REAL, math.nan, math.inf, 0.5, -1], {}),
    (OKTOPK, "band", NOT_BAND, {}),
    (OKTOPK, "imbalance", ["2", True, [2.0], math.nan, 0, -1], {}),
    (OKTOPK, "adaptive", NOT_FLAG, {}),
    (OKTOPK, "rule", [None, ["window"], 1], {}),
    (OKTOPK, "tau", [*NOT_INT, 0, -1], {}),
    (EXDYNA, "tolerance", [*NOT_REAL, math.nan, math.inf, -0.1, 1.0], {}),
    (EXDYNA, "rebalance", NOT_FLAG, {}),
    (EXDYNA, "rule", [None, ["window"]], {}),
    (EXDYNA, "blocks", ["3", True, 1.5, 0, -1], {}),
    (_algo("gtopk"), "k", [*NOT_INT, -1], {}),
    (_algo("auto"), "alpha", [*NOT_REAL[1:], math.nan, math.inf, -1.0], {}),  # (None: measured)
    (REUSE, "density", [*NOT_REAL, math.nan, 1.5, -0.1], {}),
    (REUSE, "interval", [*NOT_INT, 0, -1, math.inf], {"k": 4}),
    (REUSE, "nudge", [*NOT_REAL, math.nan, math.inf, 1.0], {"k": 4}),
    (REUSE, "band", NOT_BAND, {"k": 4}),
    (REUSE, "hold_band", NOT_FLAG, {"k": 4}),
    (SAMPLING, "sample", [*NOT_REAL, math.nan, 0.0, 1.5], {"k": 4}),
    (SAMPLING, "min_sample", [*NOT_INT, -1], {"k": 4}),
    (SAMPLING, "band", NOT_BAND, {"k": 4}),
    (SAMPLING, "retries", [*NOT_INT, -1], {"k": 4}),
    (SAMPLING, "seed", ["x", True, 1.5, -1], {"k": 4}),
    (select.GaussianThreshold, "band", NOT_BAND, {"k": 4}),
    (_reducer, "density", [*NOT_REAL, math.nan, math.inf, 0.0, 1.5], {}),
    (_reducer, "momentum", [*NOT_REAL, math.nan, 1.0, -0.1], {}),
    (_reducer, "warmup", [*NOT_INT, -1], {}),
    (_reducer, "selection", [None, ["reuse"], 1], {}),
    (_reducer, "selection_options", ["x", [("interval", 3)], 3], {"selection": "reuse"}),
    (_reducer, "average", NOT_FLAG, {}),
    (_reducer, "error_feedback", NOT_FLAG, {}),
    (_reducer, "reuse_update", NOT_FLAG, {}),
    (_reducer, "check", NOT_FLAG, {}),
    (_hook_state, "density", [*NOT_REAL, math.nan, math.inf, 0.0, 1.5], {}),
    (_hook_state, "warmup", [*NOT_INT, 0], {}),
    (_hook_state, "nonfinite", [None, "warn", 1], {}),
]


@pytest.mark.parametrize(
    ("build", "option", "value", "extra"),
    [
        pytest.param(build, option, v, extra, id=f"{getattr(build, '__name__', '')}-{option}-{v!r}")
        for build, option, values, extra in CASES
        for v in values
    ],
)
def test_a_bad_option_is_named(build, option, value, extra):
    with pytest.raises((TypeError, ValueError)) as info:
        build(**extra, **{option: value})
    # TypeError or ValueError themselves (or the library's subclasses), never a numpy or
    # unpacking error that happens to derive from them; the message names the option
    assert info.type.__module__ in ("builtins", "sparsecoll.errors"), info.value
    assert option in str(info.value), info.value


INTEGER_OPTIONS = {"tau", "blocks", "k", "interval", "warmup", "min_sample", "retries", "seed"}
FLAG_OPTIONS = {"adaptive", "rebalance", "hold_band", "average", "error_feedback", "reuse_update"}
CHOICE_OPTIONS = {"rule", "selection", "nonfinite"}


def _is_real(v):
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _wrong_type(option, value):
    """Whether ``value`` has the wrong type for ``option`` (numpy's convention: TypeError),
    rather than a wrong value of the right type (ValueError)."""
    if option in INTEGER_OPTIONS:
        return not isinstance(value, numbers.Integral) or isinstance(value, bool)
    if option in FLAG_OPTIONS or option == "check":
        return not isinstance(value, bool)
    if option in CHOICE_OPTIONS:
        return not isinstance(value, str)
    if option == "band":
        pair = isinstance(value, (list, tuple)) and len(value) == 2
        return not (pair and all(_is_real(v) for v in value))
    if option == "selection_options":
        return not isinstance(value, dict)
    return not _is_real(value)  # the real-number options


@pytest.mark.parametrize(
    ("build", "option", "value", "extra"),
    [
        pytest.param(build, option, v, extra, id=f"{getattr(build, '__name__', '')}-{option}-{v!r}")
        for build, option, values, extra in CASES
        if build is not _hook_state  # (its options: sparsecoll/integrations/torch/_state.py)
        for v in values
    ],
)
def test_a_wrong_type_is_a_type_error_and_a_wrong_value_a_value_error(build, option, value, extra):
    expected = TypeError if _wrong_type(option, value) else ValueError
    if build is REUSE and option == "density" and value is None:
        expected = ValueError  # (None is the default: then neither k nor density is given)
    with pytest.raises((TypeError, ValueError)) as info:
        build(**extra, **{option: value})
    assert isinstance(info.value, expected), (type(info.value).__name__, info.value)


@pytest.mark.parametrize(
    ("build", "option", "value"),
    [
        (OKTOPK, "imbalance", None),
        (OKTOPK, "imbalance", math.inf),
        (OKTOPK, "band", [0.5, 2]),
        (EXDYNA, "blocks", None),
        (_algo("auto"), "alpha", 1),
        (_algo("auto"), "alpha", None),
        (SAMPLING, "seed", None),
        (SAMPLING, "seed", [1, 2]),
        (SAMPLING, "min_sample", 0),
    ],
)
def test_good_options_still_taken(build, option, value):
    extra = {"k": 4} if build in (REUSE, SAMPLING) else {}
    build(**extra, **{option: value})


@pytest.mark.parametrize(
    ("build", "option"), [(OKTOPK, "tau"), (OKTOPK, "tau_prime"), (EXDYNA, "blocks")]
)
def test_an_integer_option_beyond_int64_is_named(build, option):
    """The ranks agree on these options as int64: 2**63 was taken here and refused at the
    call as 'an algorithm option does not fit in int64: ...', naming none."""
    with pytest.raises(ValueError, match=rf"^{option} must be below 2\*\*63, got {2**63}$"):
        build(**{option: 2**63})
    build(**{option: 2**63 - 1})


def test_a_reducer_n_beyond_int64_is_named_n():
    """GradientReducer(n=2**70) said 'k must be below 2**63, got 118059162071741136896' (k
    is the reducer's own, from density), and n=2**63 was taken."""
    for n in (2**63, 2**70):
        with pytest.raises(ValueError, match=r"^n must be below 2\*\*63"):
            GradientReducer(MPI.COMM_WORLD, n, "oktopk")


SETTABLE = [
    # (build, attribute, bad values): checked as the constructor checks them
    (_reducer, "warmup", [*NOT_INT, -1]),
    (_reducer, "momentum", [*NOT_REAL, math.nan, 1.0, -0.1]),
    (_reducer, "average", NOT_FLAG),
    (_reducer, "error_feedback", NOT_FLAG),
    (_reducer, "reuse_update", NOT_FLAG),
    (_reducer, "check", NOT_FLAG),
    (_hook_state, "warmup", [*NOT_INT, 0, -1]),
    (_hook_state, "density", [*NOT_REAL, math.nan, 0.0, 1.5]),
    (_hook_state, "nonfinite", [None, "warn"]),
]


@pytest.mark.parametrize(
    ("build", "option", "value"),
    [
        pytest.param(build, option, v, id=f"{build.__name__}-{option}-{v!r}")
        for build, option, values in SETTABLE
        for v in values
    ],
)
def test_a_bad_value_set_is_refused_as_at_construction(build, option, value):
    """What the constructors refuse is refused when set between steps, the attribute left as
    it was. Before, GradientReducer's were plain attributes (red.warmup = "3" failed the
    next step with a comparison's TypeError, red.average = "no" was taken as True) and a
    hook state's warmup too (state.warmup = 2.5 was taken, "2" made every later bucket
    raise '>=' not supported between instances of 'int' and 'str')."""
    obj = build()
    before = getattr(obj, option)
    with pytest.raises((TypeError, ValueError)) as info:
        setattr(obj, option, value)
    assert info.type.__module__ == "builtins", info.value
    assert option in str(info.value), info.value
    if build is _reducer or option == "warmup":
        expected = TypeError if _wrong_type(option, value) else ValueError
        assert isinstance(info.value, expected), (type(info.value).__name__, info.value)
    assert getattr(obj, option) == before


@pytest.mark.parametrize("option", ["n", "k", "algorithm_name", "selection", "comm"])
def test_what_a_reducer_is_built_for_cannot_be_set(option):
    """n, k, the communicator, the algorithm and the selection: its algorithm, estimator and
    buffers are built for them. Before, red.k = 50 on one rank changed that rank's local
    top-k alone (scratch p_warm.py at P=2: no error, 50 entries a step from that rank)."""
    red = _reducer()
    before = getattr(red, option)
    with pytest.raises(AttributeError, match=f"GradientReducer's {option} is fixed at constr"):
        setattr(red, option, 4)
    assert getattr(red, option) == before


def _library_options() -> list[tuple[str, str]]:
    """(algorithm, option) for every option of sparsecoll's own algorithms."""
    import inspect

    from sparsecoll import available_algorithms
    from sparsecoll.registry import algorithm_class

    found = []
    for name in available_algorithms():
        cls = algorithm_class(name)
        if cls.__module__.startswith("sparsecoll."):
            params = inspect.signature(cls.__init__).parameters
            found += [(name, p) for p in params if p != "self"]
    return found


@pytest.mark.parametrize(("name", "option"), _library_options())
def test_an_algorithms_options_cannot_be_set_after_construction(name, option):
    """Every option of every algorithm (gtopk's k; oktopk's k, tau, tau_prime, nudge, band,
    adaptive, rule, imbalance; exdyna's k, blocks, rule, rebalance, tolerance; auto's
    constants) is fixed once built, as a GradientReducer's k is: setting or deleting it
    raises AttributeError saying to build a new instance, and the value stays. Before, they
    were plain attributes taken unchecked (scratch p_set.py at P=2: oktopk's a.k = -1,
    a.rule = "bogus", a.band = (2.0, 1.0), exdyna's a.blocks = 0, a.tolerance = 5.0 gave
    results silently; oktopk's a.tau = 0 raised ZeroDivisionError in the next call;
    auto's a.alpha = -1.0 made an attribute no choice read). The state that calls change
    (e.g. reset(), a checkpoint's load) is set as before."""
    needs_k = "k" in algorithm_class(name).required
    algo = get_algorithm(name, **({"k": 4} if needs_k else {}))
    before = getattr(algo, option)
    match = f"algorithm {name!r}'s {option} is fixed at construction.*get_algorithm"
    for value in (before, -1, "bogus"):
        with pytest.raises(AttributeError, match=match):
            setattr(algo, option, value)
    with pytest.raises(AttributeError, match=f"{option} is fixed at construction.*deleted"):
        delattr(algo, option)
    assert getattr(algo, option) == before
    if hasattr(algo, "reset"):  # (a stateful one's: its state only)
        algo.reset()
        assert getattr(algo, option) == before


def test_an_algorithms_state_and_other_attributes_can_be_set():
    """Only the options are fixed: what calls change, and attributes of a user's own."""
    algo = get_algorithm("oktopk", k=4)
    algo.threshold, algo.mine = 0.5, 1
    assert (algo.threshold, algo.mine) == (0.5, 1)
    auto = get_algorithm("auto")
    with pytest.raises(AttributeError, match="'auto''s model is fixed"):
        auto.model = auto.model


def test_a_reducer_set_alike_steps_with_the_new_values():
    """Set between steps, warmup, average and error_feedback take effect at the next step;
    momentum set to 0 drops the velocity (a state_dict holding one without momentum is one
    no reducer loads)."""
    import numpy as np

    red = GradientReducer(MPI.COMM_WORLD, 8, "allgather", 0.25, momentum=0.5)
    grad = np.arange(8.0)
    red.step(grad)
    red.warmup = 3  # (step 1 < 3: dense)
    assert np.array_equal(red.step(grad), grad + np.r_[np.arange(6.0) * 1.5, 0, 0])
    red.momentum = 0.0
    assert red.velocity is None
    red.warmup, red.error_feedback = 0, False
    assert np.count_nonzero(red.step(grad)) == 2 and not red.residual[6:].any()
    fresh = GradientReducer(MPI.COMM_WORLD, 8, "allgather", 0.25, error_feedback=False)
    fresh.load_state_dict(red.state_dict())  # (the identity saved: momentum 0, no velocity)
