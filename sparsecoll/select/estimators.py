"""Threshold estimators: turn a requested k (or density) into a threshold, select, and report.

Every estimator is a small stateful object with ``select(x) -> Selection``; the Selection
carries the indices and values chosen, the threshold used, the requested k and the achieved
count, so callers and benchmarks can print requested vs achieved density. Each class states
the band its achieved count lands in (``band``, as multiples of k); the tests check the bands
on synthetic gradient-like data (Gaussian and heavy-tailed).

* ExactThreshold: the exact top-k every call (the k-th largest |x| is the threshold).
  Count: exactly k.
* ReuseThreshold (Ok-Topk): exact top-k every ``interval`` calls; in between, reuse the
  threshold, nudged by ``nudge`` after a call whose count left ``band``. With ``hold_band``
  (the default) a reuse call outside the band keeps the exact top-k instead: of its
  selection when above (the threshold still nudged up), of x when below (a recompute).
  Count: exactly k on recompute calls, within ``band`` on reuse calls (fewer only when x
  has fewer nonzeros). Without ``hold_band`` (Ok-Topk as published) a reuse call's count is
  what the threshold gives: within the band while the data drift slowly, pulled back by the
  nudges after a jump. Also usable for a threshold computed elsewhere (a global one):
  ``due`` says when to recompute, ``observe`` takes the count (and the exact threshold).
* SamplingThreshold (DGC): the k·s/n-th largest |x| of a stratified random sample of s
  entries; too many selected: keep the exact top-k of them; too few: retry lower, then
  fall back to the exact top-k. Count: within [0.8k, 1.3k] (exactly k after a trim).
* GaussianThreshold (Gaussian-k): fit mean and std, take the normal quantile for density
  k/n; if the count leaves ``band``, refit the tail from the observed count (then secant steps
  on log count, then regula falsi once bracketed), ``retries`` times at most; still outside
  the band after that: keep the exact top-k of the selection (or of x, when too few).
  Count: within ``band`` ([0.8k, 1.25k]) always.

All estimators work on numpy and CuPy arrays through the ``sparsecoll.select`` functions.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from abc import ABC, abstractmethod
from statistics import NormalDist
from typing import Any, ClassVar

import numpy as np

from .._array import get_array_module, identity, to_module
from .._options import count_band, flag, integer, real
from .._state import Kind, count, optional, positive
from ..sparse import SparseVector
from ._common import smallest_magnitude
from ._dispatch import _prepare, count_ge, kth_largest_abs, moments, threshold, topk

__all__ = [
    "ExactThreshold",
    "GaussianThreshold",
    "ReuseThreshold",
    "SamplingThreshold",
    "Selection",
    "ThresholdEstimator",
]

_NORMAL = NormalDist()


@dataclasses.dataclass(frozen=True)
class Selection:
    """What an estimator selected and how.

    Attributes:
        indices, values: the selected entries (indices ascending, values = x[indices]).
        threshold: the |x| cut used (the k-th largest |x| for exact selections).
        k: the requested count; n: the length of x.
        method: how the threshold was found (e.g. "exact", "reuse", "sample-topk").
        tries: thresholds tried on x (each a count or selection pass), the kept one included.
    """

    indices: Any
    values: Any
    threshold: float
    k: int
    n: int
    method: str
    tries: int = 1

    @property
    def count(self) -> int:
        """The achieved count."""
        return int(self.indices.shape[0])

    @property
    def requested_density(self) -> float:
        return self.k / self.n if self.n else 0.0

    @property
    def achieved_density(self) -> float:
        return self.count / self.n if self.n else 0.0

    @property
    def ratio(self) -> float:
        """Achieved over requested count (1.0 when k == 0 and nothing was selected)."""
        return self.count / self.k if self.k else float(self.count == 0)

    def to_sparse(self) -> SparseVector:
        """The selection as a coalesced SparseVector of length n."""
        return SparseVector(self.indices, self.values, self.n)

    def __repr__(self) -> str:
        return (
            f"Selection(method={self.method!r}, k={self.k}, count={self.count}, n={self.n}, "
            f"threshold={self.threshold:.6g}, tries={self.tries})"
        )


class ThresholdEstimator(ABC):
    """Base class: the requested size, as ``k`` or as ``density`` (k = round(density·n)).

    ``band`` is the stated count band (multiples of k) of the default settings.
    ``state_kinds``: the slots that calls change (what a GradientReducer checkpoint's
    ``selection_state`` restores), each with its kind (:mod:`sparsecoll._state`); the other
    slots are the constructor's, which a checkpoint must hold alike. ``state_version``: the
    version of that state's meaning, saved with it (raise it when a slot keeps its name but
    changes what it holds).
    """

    __slots__ = ("density", "k")
    band: ClassVar[tuple[float, float]] = (1.0, 1.0)
    name: ClassVar[str] = ""
    state_kinds: ClassVar[dict[str, Kind]] = {}
    state_version: ClassVar[int] = 1

    def __init__(self, k: int | None = None, *, density: float | None = None) -> None:
        if (k is None) == (density is None):
            raise ValueError("give exactly one of k and density")
        if k is not None:
            k = integer("k", k, 0)
        if density is not None:
            density = real("density", density)
            if not 0.0 <= density <= 1.0:
                raise ValueError(f"density must be in [0, 1], got {density!r}")
        self.k = k
        self.density = density

    def k_for(self, n: int) -> int:
        """The requested count for a vector of length n (never above n)."""
        if self.k is not None:
            return min(self.k, n)
        return min(n, round(self.density * n))

    def __call__(self, x: Any) -> Selection:
        return self.select(x)

    def select(self, x: Any) -> Selection:
        """Select about k entries of x by |x| and report how it went."""
        arr, _, wrap = _prepare(x)
        n = int(arr.shape[0])
        sel = self._select(arr, n, self.k_for(n))
        if wrap is not identity:
            sel = dataclasses.replace(sel, indices=wrap(sel.indices), values=wrap(sel.values))
        return sel

    @abstractmethod
    def _select(self, x: Any, n: int, k: int) -> Selection:
        """Select from the numpy/CuPy array x of length n, about k entries."""


def _exact(x: Any, n: int, k: int, method: str, tries: int = 1) -> Selection:
    """The exact top-k, with the k-th largest |x| as its threshold."""
    idx, vals = topk(x, k)
    t = smallest_magnitude(vals) if k else math.inf
    return Selection(idx, vals, t, k, n, method, tries)


class ExactThreshold(ThresholdEstimator):
    """The exact top-k on every call: the threshold is the k-th largest |x|."""

    __slots__ = ()
    name = "exact"

    def _select(self, x: Any, n: int, k: int) -> Selection:
        return _exact(x, n, k, "exact")


class ReuseThreshold(ThresholdEstimator):
    """Ok-Topk's rule: exact every ``interval`` calls, reused and nudged in between.

    Args:
        k, density: the requested size.
        interval: calls between exact recomputes (tau; 32 in Ok-Topk for VGG/LSTM).
        nudge: factor (> 1) the threshold is divided by after a call below ``band[0]·k``
            and multiplied by after one above ``band[1]·k``.
        band: the count band, as multiples of k.
        hold_band: a reuse call whose count leaves ``band`` keeps the exact top-k instead:
            the top k of its selection when above the band, the top k of x when below (an
            exact recompute, one more pass; not when the threshold already selects every
            nonzero). False: the count as the threshold gives it (Ok-Topk's rule as
            published), which under error feedback or a change of scale can be many times
            k, or 0, for the rest of the interval.
    """

    __slots__ = ("_t", "hi", "hold_band", "interval", "lo", "nudge", "recomputes", "step")
    band = (0.8, 1.25)
    name = "reuse"
    # (a threshold is never 0 or NaN: observe() keeps it >= the smallest positive float)
    state_kinds: ClassVar[dict[str, Kind]] = {
        "_t": optional(positive),
        "step": count,
        "recomputes": count,
    }

    def __init__(
        self,
        k: int | None = None,
        *,
        density: float | None = None,
        interval: int = 32,
        nudge: float = 1.02,
        band: tuple[float, float] = (0.8, 1.25),
        hold_band: bool = True,
    ) -> None:
        super().__init__(k, density=density)
        self.interval = integer("interval", interval, 1)
        self.nudge = real("nudge", nudge)
        if not 1.0 < self.nudge < math.inf:
            raise ValueError(f"nudge must be a finite number > 1, got {nudge!r}")
        self.lo, self.hi = count_band("band", band)
        self.hold_band = flag("hold_band", hold_band)
        self.step = 0
        self.recomputes = 0
        self._t: float | None = None

    @property
    def threshold(self) -> float | None:
        """The threshold the next reuse call will use (None before the first call)."""
        return self._t

    @property
    def due(self) -> bool:
        """Whether the next call recomputes the threshold exactly."""
        return self._t is None or self.step % self.interval == 0

    def observe(self, count: int, k: int, exact: float | None = None) -> None:
        """Record one step: ``exact`` is the threshold just computed exactly (on a due step),
        else ``count`` (selected with the current threshold) drives the nudging.

        Raises:
            TypeError: count or k no integer, exact no real number.
            ValueError: count or k negative, exact NaN or negative (it is a k-th largest
                |x|), or no exact threshold yet; the state is then as it was.
        """
        # (checked before the step counts: a NaN or negative exact became the smallest
        # positive threshold, which selects every nonzero, and count="5" raised the
        # comparison's TypeError after the step had counted)
        count = integer("count", count, 0)
        k = integer("k", k, 0)
        if exact is not None:
            exact = real("exact", exact)
            if not exact >= 0.0:
                raise ValueError(
                    f"exact must be a threshold >= 0 (a k-th largest |x|), got {exact!r}"
                )
        elif self._t is None:
            raise ValueError("observe(count) before any exact threshold")
        self.step += 1
        if exact is not None:
            # a k-th largest |x| of 0 (fewer than k nonzeros): reusing 0 would select every
            # entry, zeros included; the smallest positive value selects the nonzeros
            self._t = float(exact) if exact > 0.0 else math.ulp(0.0)
            self.recomputes += 1
            return
        if count < self.lo * k:
            # (from inf, an exact step's k-th value: the largest finite value instead; never
            # below the smallest positive one, which a nudge >= 2 would round to 0: reusing 0
            # selects every entry)
            t = min(self._t, sys.float_info.max) / self.nudge
            self._t = max(t, math.ulp(0.0))
        elif count > self.hi * k:
            # A zero threshold cannot be scaled up: restart from the smallest positive value.
            self._t = self._t * self.nudge if self._t > 0.0 else math.ulp(0.0)

    def _select(self, x: Any, n: int, k: int) -> Selection:
        if self.due:
            sel = _exact(x, n, k, "reuse-exact")
            self.observe(sel.count, k, exact=sel.threshold)
            return sel
        t = self._t
        idx, vals = threshold(x, t)
        c = int(idx.shape[0])
        if self.hold_band and self.below(c, k):
            sel = _exact(x, n, k, "reuse-exact", 2)
            self.observe(sel.count, k, exact=sel.threshold)
            return sel
        self.observe(c, k)
        if self.hold_band and c > self.hi * k:
            keep, vals = topk(vals, k)
            t = _smallest_kept(vals)
            return Selection(idx[keep], vals, t, k, n, "reuse-topk")
        return Selection(idx, vals, t, k, n, "reuse")

    def below(self, count: int, k: int) -> bool:
        """Whether a reuse call that selected ``count`` falls below the band with more to
        find: its threshold is above the smallest positive value (which selects every
        nonzero, so that fewer than k nonzeros is not a miss)."""
        return count < self.lo * k and self._t is not None and self._t > math.ulp(0.0)


def _smallest_kept(vals: Any) -> float:
    """The threshold a trimmed selection reports: its smallest |value| (inf when it kept
    nothing, as for k = 0)."""
    return smallest_magnitude(vals) if vals.shape[0] else math.inf


class SamplingThreshold(ThresholdEstimator):
    """DGC's rule: the threshold is the matching order statistic of a random sample.

    Args:
        k, density: the requested size.
        sample: fraction of x sampled (stratified: one random entry per stride).
        min_sample: sample at least this many entries (all of x when n is smaller).
        band: accepted count band, as multiples of k; above it the exact top-k of the
            selected entries is kept (count k), below it the sample rank is raised.
        retries: extra thresholds tried when too few are selected, before the exact top-k.
        seed: seed of the sampling generator (the sequence of calls is reproducible).
    """

    __slots__ = ("hi", "lo", "min_sample", "retries", "rng", "sample")
    band = (0.8, 1.3)
    name = "sample"
    state_kinds: ClassVar[dict[str, Kind]] = {"rng": lambda value, n, size: _generator(value)}

    def __init__(
        self,
        k: int | None = None,
        *,
        density: float | None = None,
        sample: float = 0.01,
        min_sample: int = 4096,
        band: tuple[float, float] = (0.8, 1.3),
        retries: int = 2,
        seed: int = 0,
    ) -> None:
        super().__init__(k, density=density)
        self.sample = real("sample", sample)
        if not 0.0 < self.sample <= 1.0:
            raise ValueError(f"sample must be in (0, 1], got {sample!r}")
        self.min_sample = integer("min_sample", min_sample, 0)
        self.lo, self.hi = count_band("band", band)
        self.retries = integer("retries", retries, 0)
        if isinstance(seed, (bool, np.bool_)):
            raise TypeError("seed must be an integer >= 0, a sequence of them, or None, got bool")
        try:
            self.rng = np.random.default_rng(seed)
        except (TypeError, ValueError) as exc:
            raise type(exc)(
                f"seed must be an integer >= 0, a sequence of them, or None, got {seed!r}"
            ) from exc

    def _draw(self, x: Any, n: int) -> Any:
        s = min(n, max(self.min_sample, math.ceil(self.sample * n)))
        stride = n // s
        s = n // stride
        pos = np.arange(s, dtype=np.int64) * stride + self.rng.integers(0, stride, s)
        return x[to_module(pos, get_array_module(x))]

    def _select(self, x: Any, n: int, k: int) -> Selection:
        if k == 0 or k == n:
            return _exact(x, n, k, "sample-exact")
        sample = self._draw(x, n)
        s = int(sample.shape[0])
        r = min(s, max(1, round(k * s / n)))
        for tries in range(1, self.retries + 2):
            # (a sampled 0, as ReuseThreshold's: the smallest positive value, never zeros)
            t = max(kth_largest_abs(sample, r), math.ulp(0.0))
            idx, vals = threshold(x, t)
            c = int(idx.shape[0])
            if c > self.hi * k:
                pos, vals = topk(vals, k)
                t = _smallest_kept(vals)
                return Selection(idx[pos], vals, t, k, n, "sample-topk", tries)
            if c >= self.lo * k:
                return Selection(idx, vals, t, k, n, "sample", tries)
            if r == s:
                break
            # Too few: move down the sample in proportion to the shortfall.
            r = min(s, max(r + 1, math.ceil(r * k / max(c, 1))))
        return _exact(x, n, k, "sample-exact", tries + 1)


def _generator(value: Any) -> Any:
    """A numpy Generator (SamplingThreshold's, where its draws go on from)."""
    if not isinstance(value, np.random.Generator):
        raise TypeError(f"must be a numpy random Generator, got {type(value).__name__}")
    return value


def _tail(t: float, mean: float, std: float) -> float:
    """P(|X| >= t) for X ~ N(mean, std^2)."""
    return _NORMAL.cdf((-t - mean) / std) + _NORMAL.cdf((mean - t) / std)


def _normal_abs_quantile(p: float, mean: float, std: float) -> float:
    """The t with P(|X| >= t) = p for X ~ N(mean, std^2), by bisection (p in (0, 1))."""
    lo, hi = 0.0, abs(mean) + 40.0 * std
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if _tail(mid, mean, std) > p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _abs_quantile(p: float, mean: float, std: float, fit: float = 1.0) -> float:
    """:func:`_normal_abs_quantile` for ``(mean, std·fit)``, computed in units of std (so
    for any finite scale: 40·std alone passes float64 above ~4e306), and held to the
    largest float (any threshold above every finite |x| selects the same)."""
    return min(std * _normal_abs_quantile(p, mean / std, fit), sys.float_info.max)


def _fit_std(t: float, p: float, mean: float, std: float) -> float:
    """The std that puts a tail mass p beyond t (the mean held), by bisection in log std."""
    lo, hi = math.log(std) - 50.0, math.log(std) + 50.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if _tail(t, mean, math.exp(mid)) < p:
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi))


class GaussianThreshold(ThresholdEstimator):
    """Gaussian-k: the threshold from a normal fit of x, corrected from the observed count.

    Args:
        k, density: the requested size.
        band: accepted count band, as multiples of k.
        retries: count passes spent correcting a threshold outside the band.
    """

    __slots__ = ("hi", "lo", "retries")
    band = (0.8, 1.25)
    name = "gaussian"

    def __init__(
        self,
        k: int | None = None,
        *,
        density: float | None = None,
        band: tuple[float, float] = (0.8, 1.25),
        retries: int = 6,
    ) -> None:
        super().__init__(k, density=density)
        self.lo, self.hi = count_band("band", band)
        self.retries = integer("retries", retries, 0)

    def _select(self, x: Any, n: int, k: int) -> Selection:
        if k == 0 or k == n:
            return _exact(x, n, k, "gaussian-exact")
        mean, std = moments(x)
        if not (math.isfinite(mean) and math.isfinite(std)) or std == 0.0:
            return _exact(x, n, k, "gaussian-exact")
        t = _abs_quantile(k / n, mean, std)
        search = _TailSearch(k, n, mean, std)
        for _ in range(self.retries):
            c = count_ge(x, t)
            if self.lo * k <= c <= self.hi * k:
                break
            t = search.next(t, c)
        else:
            c = count_ge(x, t)
        tries = len(search.tried) + 1
        if c > self.hi * k:  # retries ran out above the band: keep the top k of the selection
            idx, vals = threshold(x, t)
            keep, kept = topk(vals, k)
            # (its threshold: the smallest |value| kept, as the other trimmed selections)
            return Selection(idx[keep], kept, _smallest_kept(kept), k, n, "gaussian-topk", tries)
        if c < self.lo * k:  # below the band: the exact top-k
            return _exact(x, n, k, "gaussian-topk", tries + 1)
        idx, vals = threshold(x, t)
        return Selection(idx, vals, t, k, n, "gaussian", tries)


class _TailSearch:
    """Find t with count(|x| >= t) near k from counts seen so far.

    The first correction refits the normal's scale to the count seen; later ones take a
    secant step on log(count) against log(t) (tails look like power laws over short
    ranges), kept inside the bracket of thresholds known too low and too high, and at most
    a factor MAX_STEP from the last threshold while no bracket exists.
    """

    MAX_STEP = 8.0

    def __init__(self, k: int, n: int, mean: float, std: float) -> None:
        self.k, self.n, self.mean, self.std = k, n, mean, std
        self.tried: list[tuple[float, int]] = []
        # The bracket: the largest threshold that selected too many and the smallest that
        # selected too few, each with log(count / k) (Illinois-scaled when that end is stale).
        self.too_low, self.f_low = 0.0, 0.0
        self.too_high, self.f_high = math.inf, 0.0
        self._last_side = 0

    def next(self, t: float, c: int) -> float:
        self.tried.append((t, c))
        f = math.log(max(c, 0.5) / self.k)
        side = 1 if c > self.k else -1
        if side == 1 and t > self.too_low:
            self.too_low, self.f_low = t, f
            if self._last_side == 1:
                self.f_high *= 0.5
        elif side == -1 and t < self.too_high:
            self.too_high, self.f_high = t, f
            if self._last_side == -1:
                self.f_low *= 0.5
        self._last_side = side
        guess = math.nan
        if len(self.tried) == 1:
            q = min(max(c, 0.5), self.n - 0.5) / self.n
            u = self.std  # (in units of std: exp(log(std) ± 50) passes float64's range)
            fit = _fit_std(t / u, q, self.mean / u, 1.0)
            guess = _abs_quantile(self.k / self.n, self.mean, u, fit)
        else:
            (t0, c0), (t1, c1) = self.tried[-2], self.tried[-1]
            if c0 > 0 and c1 > 0 and c0 != c1 and t0 > 0 and t1 > 0 and t0 != t1:
                slope = (math.log(c1) - math.log(c0)) / (math.log(t1) - math.log(t0))
                # a nearly flat count (quantised x: few distinct |values|) asks for a huge
                # step; it is held to MAX_STEP below anyway, so cap it before exp overflows
                most = math.log(self.MAX_STEP)
                move = (math.log(self.k) - math.log(c1)) / slope
                guess = t1 * math.exp(min(max(move, -most), most))
        if self.too_low > 0.0 and self.too_high < math.inf:
            # Bracketed: interpolate log count against log t between the bracket's ends
            # (Illinois regula falsi), bisecting in log t when that lands near an end.
            lt0, lt1 = math.log(self.too_low), math.log(self.too_high)
            frac = self.f_low / (self.f_low - self.f_high)
            if not 0.05 <= frac <= 0.95:
                frac = 0.5
            guess = math.exp(lt0 + frac * (lt1 - lt0))
        else:
            step = self.MAX_STEP if c < self.k else 1.0 / self.MAX_STEP
            if not (math.isfinite(guess) and guess > 0.0):
                guess = t / step
            guess = min(max(guess, t / self.MAX_STEP), t * self.MAX_STEP)
            if t == 0.0:
                guess = math.ulp(0.0)
        return min(guess, sys.float_info.max)  # (t·MAX_STEP near the top of float64)
