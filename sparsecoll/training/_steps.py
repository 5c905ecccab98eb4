"""A GradientReducer step's strategies: how it selects and reduces, one class per way.

The reducer picks its strategy once, from its algorithm and selection (:func:`strategy_for`);
its warm-up steps use :class:`DenseStep`. Every step runs the same course:
:meth:`~StepStrategy.plan` says which cut and range the one pass over the gradient
(:func:`sparsecoll.select.accumulate`) collects candidates from, :meth:`~StepStrategy.choose`
makes this rank's selection from them, and, once every rank agreed on its input,
:meth:`~StepStrategy.exchange` runs the collective and says which entries left the
accumulated vector. Until then nothing the reducer keeps has changed, except what
:func:`snapshot` saves and :func:`restore` gives back (a cut prediction, an estimator's
schedule or generator).
"""

from __future__ import annotations

import math
import time
from typing import Any, ClassVar, NamedTuple

import numpy as np

from .. import select
from .._array import get_array_module, nonzero_mask
from .._state import Kind, optional, positive, within
from ..algorithms.base import Algorithm
from ..api import reduce_checked
from ..comm import Communicator, widening_buffer
from ..select._common import round_threshold, smallest_magnitude
from ..sparse import SparseVector

__all__ = [
    "PREDICTION",
    "DenseStep",
    "Exchange",
    "Pass",
    "Prediction",
    "Prepared",
    "StepStrategy",
    "numba_host",
    "restore",
    "selects_by_itself",
    "snapshot",
    "strategy_for",
]

CUT_TARGET = 1.6  # candidates the exact top-k's predicted cut aims at, in multiples of k
CAP_FACTOR = 4  # candidates kept at most, in multiples of k (more: the prediction missed)
# the cut after a step with fewer than k nonzeros (the smallest positive float64: rounded up
# to the data's dtype, |x| >= it holds exactly for the nonzeros), so that the pass collects
# every nonzero and the next step needs no exact top-k while that lasts (an embedding's
# gradient: a few rows per step)
EVERY_NONZERO = math.ulp(0.0)
# the exact top-k's predicted cut as a checkpoint's "topk_state" holds it: each saved name's
# kind (a restored run predicts its first cut as the saved run would have)
PREDICTION: dict[str, Kind] = {
    "_cut": optional(positive),
    "_kth": within(0.0, math.inf),
    "_growth": within(-0.5, 0.5),
    "_slope": within(1.0, 30.0),
    "_zcut": within(0.0, math.inf),
}


class Prediction:
    """The exact local top-k's candidate cut, predicted from the steps before."""

    __slots__ = ("cut", "full_topk", "growth", "kth", "slope", "zcut")

    def __init__(self) -> None:
        self.cut: float | None = None  # the next pass's candidate cut (None: no prediction)
        self.kth = 0.0  # the last exact top-k's k-th largest |value|
        self.growth = 0.0  # its smoothed log growth per step
        self.slope = 5.0  # d log(count) / d log(1/cut) near it (a Gaussian tail at 1%: ~5)
        self.zcut = math.inf  # the next k-th largest |value|, predicted
        self.full_topk = 0  # steps whose cut missed: a top-k over all of acc (since built)

    def values(self) -> dict[str, Any]:
        """What a checkpoint's topk_state holds (each slot under its name with a leading
        underscore)."""
        return {name: getattr(self, name[1:]) for name in PREDICTION}

    def load(self, saved: dict[str, Any]) -> None:
        """Take a checkpoint's topk_state (checked)."""
        for name, value in saved.items():
            setattr(self, name[1:], value)

    def update(self, found: select.Accumulation, kth: float, k: int) -> None:
        """Next step's candidate cut, aiming at CUT_TARGET·k candidates: this step's k-th
        largest |value|, times its smoothed growth per step, lowered by the tail's local
        slope (how fast the count rises below the k-th value, measured between this step's
        cut and its k-th value; a miss makes it more careful)."""
        cut = self.cut
        if cut is not None and 0 < cut < kth and found.hits > k:
            slope = math.log(found.hits / k) / math.log(kth / cut)
            self.slope = min(max(slope, 1.0), 30.0)
        elif cut is not None and found.hits < k:
            self.slope = max(1.0, self.slope / 2)
        if self.kth > 0 and kth > 0:
            step = min(max(math.log(kth / self.kth), -0.5), 0.5)
            self.growth = 0.5 * self.growth + 0.5 * step
        self.kth = kth
        self.zcut = kth * math.exp(self.growth)
        pred = self.zcut * CUT_TARGET ** (-1.0 / self.slope)
        self.cut = pred if pred > 0 else EVERY_NONZERO if k else None


class Pass(NamedTuple):
    """What the pass over the gradient collects: entries with ``|acc| >= cut`` in
    ``[lo, hi)``, at most ``cap`` of them; (Numba) those from ``zero_cut`` up leave acc."""

    cut: float
    lo: int
    hi: int
    zero_cut: float
    cap: int | None
    buckets: bool = False  # keep a histogram of the hits for select.topk_hits
    nonzeros: bool = False  # count the range's nonzeros


class Exchange(NamedTuple):
    """A sparse step's collective: its result, the indices that left acc, how many this rank
    selected, the pass's zeroed candidates (with a mask of those sent; None: not zeroed)
    and the seconds spent in the collective."""

    result: SparseVector
    sent: Any
    selected: int
    zeroed: Any
    seconds: float


class Prepared:
    """One step between its pass over the gradient and its collective."""

    __slots__ = (
        "acc", "averaged", "found", "late_zero", "old_velocity", "res", "reused", "selected",
        "strategy", "update", "velocity", "work", "x", "zeroed",
    )  # fmt: skip

    def __init__(self) -> None:
        self.reused = False
        self.averaged = False  # (float16) the collective returns the average, not the sum
        self.late_zero = False
        self.acc: Any = None
        self.res: Any = None
        self.old_velocity: Any = None
        self.found: Any = None
        self.strategy: Any = None
        self.selected: Any = None
        self.x: Any = None  # the selection as the algorithm's input
        self.update: Any = None
        self.work: Any = None  # (a dense float16 step) the float32 array it is summed in
        self.velocity: Any = None
        self.zeroed: Any = None


class StepStrategy:
    """How the reducer's steps select and reduce (see the module docstring)."""

    dense: ClassVar[bool] = False  # reduces all of acc: no selection, no exchange
    drops_sent: ClassVar[bool] = False  # the collective zeroes what it sends in acc itself

    def __init__(
        self, algorithm: Algorithm, comm: Communicator, n: int, k: int, selector: Any = None
    ) -> None:
        self.algorithm, self.comm, self.n, self.k = algorithm, comm, n, k
        self.selector = selector

    def plan(self, prep: Prepared, g: Any, numba: bool) -> Pass:
        return Pass(math.inf, 0, self.n, math.inf, CAP_FACTOR * self.k + 1024)

    def choose(self, prep: Prepared, plan: Pass, dtype: Any) -> None:
        """This rank's selection from the pass's candidates (``prep.found``)."""

    def exchange(self, prep: Prepared) -> Exchange:
        raise NotImplementedError


class DenseStep(StepStrategy):
    """All of acc is reduced (the dense algorithm, and every algorithm's warm-up)."""

    dense = True

    def plan(self, prep: Prepared, g: Any, numba: bool) -> Pass:
        prep.work = widening_buffer(prep.acc)  # (float16: made before the ranks agree too)
        return super().plan(prep, g, numba)


class ExdynaStep(StepStrategy):
    """An algorithm that sparsifies the dense accumulated vector itself (exdyna): its own
    partition and threshold; every rank drops all the entries it selected."""

    drops_sent = True

    def plan(self, prep: Prepared, g: Any, numba: bool) -> Pass:
        algo = self.algorithm
        algo.prepare(self.comm, self.n)
        lo, hi = algo.owned_range(self.comm.rank)
        cut = algo.candidate_cut(g.dtype)
        cut = math.inf if cut is None else cut
        zero_cut = math.inf
        if numba and cut < math.inf:
            zc = algo.zero_cut(g.dtype)  # it gives back what it does not take
            zero_cut = math.inf if zc is None else max(cut, zc)
        # it reads every candidate anyway: room for all (only written pages are used)
        return Pass(cut, lo, hi, zero_cut, None, nonzeros=algo.counts_nonzeros())

    def choose(self, prep: Prepared, plan: Pass, dtype: Any) -> None:
        found = prep.found
        if plan.zero_cut < math.inf and found.complete:
            prep.zeroed = (found.indices, found.values, round_threshold(plan.zero_cut, dtype))

    def exchange(self, prep: Prepared) -> Exchange:
        found = prep.found
        cand = (found.indices, found.values) if found.complete else None
        zc = None if prep.zeroed is None else prep.zeroed[2]
        t0 = time.perf_counter()
        # acc is the spare buffer: dropping the sent entries as they are read (or in the
        # pass: zc) is safe even if the call fails (the residual is untouched)
        result = self.algorithm.reduce_dense(
            self.comm,
            prep.acc,
            candidates=cand,
            drop=True,
            zeroed=zc,
            mean=prep.averaged,
            nonzeros=found.nonzeros,  # (counted in the pass when the call needs them)
        )
        seconds = time.perf_counter() - t0
        return Exchange(result, result.indices, int(result.info["selected"]), None, seconds)


class LocalStep(StepStrategy):
    """This rank's local selection goes to the algorithm (exact ones, gtopk, oktopk); only
    what ``result.contributed`` says reached the result leaves acc."""

    def pick(self, prep: Prepared, plan: Pass) -> tuple[Any, Any, Any, bool]:
        """This rank's indices and values of acc, which of the pass's hits they are (a mask;
        None: all or none of them) and whether they are all of the hits."""
        raise NotImplementedError

    def whole_again(self, prep: Prepared, plan: Pass) -> bool:
        """Whether the selection reads all of acc: the pass's zeroing is undone first."""
        return False

    def choose(self, prep: Prepared, plan: Pass, dtype: Any) -> None:
        found, acc = prep.found, prep.acc
        if plan.zero_cut < math.inf and found.complete:
            # the cut as the pass compared with it (rounded up to the dtype): the fix-ups
            # compare in that dtype too, and a cut rounded to nearest there would take an
            # entry just below it, which the pass left in acc, for one it zeroed
            prep.zeroed = (found.indices, found.values, round_threshold(plan.zero_cut, dtype))
            if self.whole_again(prep, plan):
                acc[found.indices] = found.values
                prep.zeroed = None
        idx, vals, taken, all_hits = self.pick(prep, plan)
        nonzero = nonzero_mask(vals)  # exact zeros carry nothing (on a GPU: subnormals too)
        if not bool(nonzero.all()):
            if taken is not None:
                taken = taken.copy()
                taken[taken] = nonzero
            elif all_hits:
                taken = nonzero
            idx, vals = idx[nonzero], vals[nonzero]
        prep.selected = idx, vals, taken
        if prep.averaged:  # (float16: each value's share, so that the sum fits)
            vals = shares(vals, self.comm.size)
        prep.x = SparseVector(idx, vals, self.n)
        # (its own O(n) buffers, before the ranks agree: running out of memory is then an
        # error on every rank, not this rank's alone)
        self.algorithm.preflight(prep.x)

    def exchange(self, prep: Prepared) -> Exchange:
        sel, _, taken = prep.selected
        t0 = time.perf_counter()
        result = reduce_checked(self.algorithm, self.comm, prep.x)
        seconds = time.perf_counter() - t0
        selected = int(sel.shape[0])
        sent = result.contributed  # a mask over sel, or None: all of it
        if sent is not None and bool(sent.all()):
            sent = None
        if sent is not None:
            sel = sel[sent]
        if prep.zeroed is None:
            return Exchange(result, sel, selected, None, seconds)
        cand = prep.zeroed[0]  # which of the pass's hits leave acc
        if taken is None:
            taken = get_array_module(cand).ones(cand.shape[0], dtype=bool)
        if sent is not None:
            taken = taken.copy()
            taken[taken] = sent
        return Exchange(result, sel, selected, (*prep.zeroed, taken), seconds)


class TopkStep(LocalStep):
    """The exact local top-k every step, from the candidates above a cut predicted from the
    last step (when the prediction misses: over all of acc, one more read)."""

    def __init__(self, *args: Any, prediction: Prediction, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prediction = prediction

    def plan(self, prep: Prepared, g: Any, numba: bool) -> Pass:
        pred = self.prediction
        cut = math.inf if pred.cut is None else pred.cut
        zero_cut = max(cut, pred.zcut) if numba else math.inf
        return Pass(cut, 0, self.n, zero_cut, CAP_FACTOR * self.k + 1024, buckets=True)

    def whole_again(self, prep: Prepared, plan: Pass) -> bool:
        found = prep.found
        return found.hits < self.k and not plan.cut <= EVERY_NONZERO

    def pick(self, prep: Prepared, plan: Pass) -> tuple[Any, Any, Any, bool]:
        idx, vals, taken, found, k = None, None, None, prep.found, self.k
        if found.complete and found.hits >= k:  # the top-k is among the candidates
            idx, vals, taken = select.topk_hits(found, k)
        elif found.complete and plan.cut <= EVERY_NONZERO:  # fewer than k nonzeros: all
            idx, vals = found.indices, found.values
        else:  # the predicted cut missed: a top-k over all of acc (one more read)
            idx, vals = select.topk(prep.acc, k)
            self.prediction.full_topk += 1
        self.prediction.update(found, kth(vals, k), k)
        return idx, vals, taken, False


class ReuseStep(TopkStep):
    """Ok-Topk's threshold reuse (:class:`sparsecoll.select.ReuseThreshold`): the exact
    top-k when the estimator is due, else the entries above its threshold (held in its
    band: the top k of them above it, the exact top-k below it)."""

    def plan(self, prep: Prepared, g: Any, numba: bool) -> Pass:
        if self.selector.due:
            return super().plan(prep, g, numba)
        cut = self.selector.threshold
        return Pass(cut, 0, self.n, cut if numba else math.inf, CAP_FACTOR * self.k + 1024)

    def _misses(self, found: select.Accumulation) -> bool:
        """Whether a reuse step's pass found too few entries, so that the estimator holding
        its band takes the exact top-k instead."""
        est = self.selector
        return est.hold_band and found.complete and est.below(found.hits, self.k)

    def whole_again(self, prep: Prepared, plan: Pass) -> bool:
        if self.selector.due:
            return super().whole_again(prep, plan)
        return self._misses(prep.found)

    def pick(self, prep: Prepared, plan: Pass) -> tuple[Any, Any, Any, bool]:
        est, found, k = self.selector, prep.found, self.k
        if self.selector.due:
            idx, vals, taken, _ = super().pick(prep, plan)
            est.observe(k, k, exact=self.prediction.kth)
            return idx, vals, taken, False
        if self._misses(found):  # below the band: the exact top-k of acc, a recompute
            idx, vals = select.topk(prep.acc, k)
            est.observe(k, k, exact=kth(vals, k))
            return idx, vals, None, False
        taken = None
        if found.complete:
            idx, vals = found.indices, found.values
        else:
            idx, vals = select.threshold(prep.acc, est.threshold)
        count = int(idx.shape[0])
        est.observe(count, k)
        if est.hold_band and count > est.hi * k:  # above the band: the top k of them
            keep, vals = select.topk(vals, k)
            idx = idx[keep]
            if found.complete:
                taken = get_array_module(vals).zeros(count, dtype=bool)
                taken[keep] = True
        return idx, vals, taken, found.complete


class EstimatorStep(LocalStep):
    """A threshold estimator's selection over acc (DGC's sampling, Gaussian-k)."""

    def pick(self, prep: Prepared, plan: Pass) -> tuple[Any, Any, Any, bool]:
        chosen = self.selector.select(prep.acc)
        return chosen.indices, chosen.values, None, False


def strategy_for(
    algorithm: Algorithm,
    comm: Communicator,
    n: int,
    k: int,
    *,
    dense: bool,
    selector: Any,
    prediction: Prediction,
) -> StepStrategy:
    """The strategy of a reducer's steps past the warm-up: ``dense`` (the dense algorithm),
    an algorithm with its own dense path (``reduce_dense``: it selects by itself), else by
    the local selection's estimator (``selector``; None: the exact top-k)."""
    args = (algorithm, comm, n, k)
    if dense:
        return DenseStep(*args)
    if selects_by_itself(algorithm):
        return ExdynaStep(*args)
    if selector is None:
        return TopkStep(*args, prediction=prediction)
    if isinstance(selector, select.ReuseThreshold):
        return ReuseStep(*args, selector, prediction=prediction)
    return EstimatorStep(*args, selector)


def selects_by_itself(algorithm: Any) -> bool:
    """Whether an algorithm (class or instance) sparsifies the dense accumulated vector
    itself (``reduce_dense``: its own partition and threshold), taking no local top-k."""
    return hasattr(algorithm, "reduce_dense")


def snapshot(prediction: Prediction, selector: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What a step's selection changes before the step is known to succeed on every rank:
    the cut prediction and the estimator's slots (a generator's state, not the object)."""
    sel = {}
    for name, value in slot_values(selector).items():
        if isinstance(value, np.random.Generator):
            value = (value, value.bit_generator.state)
        sel[name] = value
    return tuple(getattr(prediction, a) for a in Prediction.__slots__), sel


def restore(prediction: Prediction, selector: Any, saved: tuple[Any, ...]) -> None:
    """Give back what :func:`snapshot` saved."""
    cut, sel = saved
    for name, value in zip(Prediction.__slots__, cut):
        setattr(prediction, name, value)
    for name, value in sel.items():
        if isinstance(value, tuple) and isinstance(value[0], np.random.Generator):
            value[0].bit_generator.state = value[1]
            value = value[0]
        setattr(selector, name, value)


def slot_values(obj: Any) -> dict[str, Any]:
    """The state of a ``__slots__`` object (the selection estimators), as a dict."""
    if obj is None:
        return {}
    names = [n for c in type(obj).__mro__ for n in getattr(c, "__slots__", ())]
    return {n: getattr(obj, n) for n in names if hasattr(obj, n)}


def shares(values: Any, p: int) -> Any:
    """float16 ``values / p``, each rounded once (divided in float32, exact for any p), so
    that the sum of P ranks' shares is their average: it fits in float16 where the average
    does, with no more bytes on the wire; a share below float16's subnormals is 0."""
    xp = get_array_module(values)
    return (values.astype(xp.float32) / xp.float32(p)).astype(values.dtype)


def kth(vals: Any, k: int) -> float:
    """The k-th largest |value| of a top-k selection's ``vals`` (0.0 when it holds fewer
    than k)."""
    return smallest_magnitude(vals) if k and vals.shape[0] == k else 0.0


def numba_host(a: Any) -> bool:
    """Whether the Numba kernels serve this array (a host array they can do arithmetic on)."""
    return isinstance(a, np.ndarray) and a.dtype != np.float16 and select.backend() == "numba"
