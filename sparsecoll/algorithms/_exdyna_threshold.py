"""ExDyna's threshold pieces: the window's edges, a call's candidates and cuts through a
bucket, the re-derive from the ranks' top magnitudes, and the authors' update rule."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import select
from .._array import get_array_module, nonzero_count, to_host
from ..comm import Communicator
from ..select._common import magnitude_ge, magnitude_keys, magnitudes, shifted_float64
from ._merge import keep_bucket, take_at_least
from ._window import nudged_up, window_edges

__all__ = ["authors_rule", "derive_threshold"]


class _Found:
    """Entries of the owned range from window edge ``low`` up: their ``values`` and
    indices ``idx`` (position in the range + ``lo``; ``given``: the caller's global
    indices, else positions in the range and lo = 0). From a caller's pass
    (:meth:`ExDyna.reduce_dense`) with ``zc``, that pass left ``part`` 0 at those with
    |value| >= zc (their values are here only), until :meth:`restore` gives them back or
    :meth:`take` settles them."""

    def __init__(self, values, idx, lo=0, low=0, part=None, zc=None, given=False) -> None:
        self.values, self.idx, self.lo, self.low = values, idx, lo, low
        self.part, self.zc, self.given = part, zc, given
        self.taken = None  # the values at the positions :meth:`take` returned (with zc)

    def restore(self) -> None:
        """Make ``part`` whole again (before it is read: a re-derive or a recount)."""
        if self.zc is not None:  # nothing is >= NaN: every zeroed candidate goes back
            take_at_least(self.values, np.nan, self.idx, self.lo, self.part, self.zc)
            self.zc = None

    def take(self, t: Any, to_index: Any) -> Any:
        """The global indices with |value| >= t (``to_index`` maps positions in the range
        to them); with zc also their values (``taken``), and ``part`` then holds 0
        exactly there among the candidates."""
        part = None if self.zc is None else self.part
        idx, vals = take_at_least(self.values, t, self.idx, self.lo, part, self.zc)
        self.taken = None if part is None else vals
        return idx if self.given else to_index(idx)

    def take_bucket(self, cut: _Bucket, to_index: Any) -> Any:
        """As :meth:`take` for a cut through a bucket: the entries with |value| >= cut.hi
        and, of those in ``[cut.lo, cut.hi)`` in index order, the positions in ``cut.runs``."""
        dt = self.values.dtype.type
        idx, vals, chosen = keep_bucket(
            self.idx, self.values, dt(cut.hi), dt(cut.lo), cut.runs, cut.count, mask=True
        )
        self.taken = None
        if self.zc is not None:  # part holds 0 at |value| >= zc: make it 0 where kept
            xp = get_array_module(self.values)
            fix = chosen != magnitude_ge(self.values, self.zc)
            back = xp.where(chosen[fix], 0, self.values[fix])
            self.part[self.idx[fix] - self.lo] = back.astype(self.part.dtype)
            self.taken = vals
        return idx if self.given else to_index(idx)


class _Bucket:
    """A window call's cut through a bucket of tied (or close) magnitudes: this rank keeps
    every |value| >= ``hi`` and, of its entries in ``[lo, hi)`` in index order, those at the
    positions ``runs`` (``count`` kept in all)."""

    __slots__ = ("count", "hi", "lo", "runs", "start")

    def __init__(self, lo: float, hi: float, runs: Any, count: int, start: int) -> None:
        self.lo, self.hi, self.runs, self.count, self.start = lo, hi, runs, count, start


def _top_magnitudes(part: Any, take: int) -> Any:
    """The ``take`` largest nonzero |values| of ``part`` (fewer if it has fewer), float64.

    By the selection kernels: np.partition is slow on a part that is mostly zeros (many
    ties; e.g. an embedding's gradient, docs/reports/benchmarks.md). With a NaN in ``part`` the
    kernels raise; then a partition of the keys keeps the NaN (its key is the largest), and
    :func:`derive_threshold` reports it on every rank once gathered (raising here alone
    would leave the others waiting).
    """
    xp = get_array_module(part)
    take = min(take, nonzero_count(part))
    try:
        _, vals = select.topk(part, take)
    except ValueError:  # a NaN
        # partitioned on keys, whose NaNs lie above inf's (CuPy's abs flushes float32
        # subnormals to 0, and its float partition need not order NaN as numpy's)
        keys = magnitude_keys(part)
        m = int(keys.shape[0])
        vals = (xp.partition(keys, m - take)[m - take :] if take else keys[:0]).view(part.dtype)
    top = shifted_float64(magnitudes(vals))  # (CuPy's abs and cast flush float32 subnormals)
    return top[~(top <= 0)]  # (a NaN kept)


def _count_nonzeros(part: Any, found: _Found, counted: int | None = None) -> int:
    """The nonzeros of ``part`` as it was before the caller's pass zeroed ``found``'s
    candidates at or above ``found.zc`` (none when zc is None); -1 when it holds a NaN.
    ``counted``: that count, made by the caller in its pass (then nothing is read)."""
    if counted is not None:
        return counted
    try:
        count = select.count_ge(part, float(np.finfo(part.dtype).smallest_subnormal))
    except ValueError:  # (a NaN, in a part the caller's candidates stood for)
        return -1
    if found.zc is not None:
        count += select.count_ge(found.values, found.zc)
    return count


def _agree_no_nan(table: np.ndarray) -> None:
    """Raise on every rank when some rank flagged a NaN (a row of -1 counts)."""
    bad = np.flatnonzero(table[:, 0] < 0)
    if bad.shape[0]:
        raise ValueError(f"the accumulated gradient holds a NaN on rank {int(bad[0])}")


def _below_needed(total: np.ndarray, k: int, tol: float) -> bool:
    """Whether ``pick_edge`` over a window could pick differently with the counts of edges
    below the lowest one in ``total`` (counts there are >= total[0]): unless too many are
    kept even at the top edge, when k lies at or below total[0] + tol, or the lowest edge
    is among the nearest k (an edge below could tie with it)."""
    if total[-1] > k + tol:
        return False
    miss = np.abs(total - k)
    return bool(total[0] < k - tol or miss[0] == miss.min())


def _cut(dtype: Any, t: float) -> float:
    """``t`` as the data's dtype holds it (what ``|x| >= t`` compares against), and never 0:
    zeros are never selected."""
    return max(float(np.asarray(t).astype(dtype)), float(np.finfo(dtype).smallest_subnormal))


def _edges(threshold: float, dtype: Any) -> np.ndarray:
    """The window's edges in ``dtype`` (:func:`window_edges`), the top one at least the next
    value above the middle one (the threshold). Among the subnormals the whole window
    ×0.8–×1.25 can round onto the threshold itself (float16: below 4·2**-24); with a count
    above the threshold a tie there is cut to k (:meth:`ExDyna._bucket`) as any other."""
    edges = window_edges(threshold, dtype)
    mid = edges[edges.shape[0] // 2]
    if not edges[-1] > mid:
        edges[-1] = np.nextafter(mid, mid.dtype.type(np.inf))
    return edges


def authors_rule(threshold: float, count: int, k: int) -> float:
    """The authors' threshold update (kept for comparison; it settles below k)."""
    if count > 1.1 * k:
        return nudged_up(threshold, 1.005)
    if count <= 0.909 * k:
        return threshold * 0.995
    return nudged_up(threshold, 1.00125)


def derive_threshold(
    comm: Communicator, k: int, takes: list[int], part: Any
) -> tuple[float | None, bool]:
    """The global k-th largest nonzero |value| (collective; O(k) volume when the large
    values are spread over the partitions), and whether fewer than k came (then every
    rank sent every nonzero it has: all there are).

    Every rank r sends its top ``takes[r]`` nonzero magnitudes of ``part`` (its partition;
    fewer if it has fewer), and the k-th largest of the gathered ones is the estimate (the
    smallest when fewer than k came; None when every partition is all zeros). The estimate
    can only be too low, and only when some rank sent all ``takes[r]`` it was asked for and
    they all lie at or above it: its partition holds more than its share of the large
    values (a layer of a larger scale). Every rank sees that in the gathered data alike;
    those ranks send twice as many (at most k) in another allgatherv, until none is.
    The estimate is then exact: every value at or above it has been gathered.
    """
    chunks: list[np.ndarray] = [np.zeros(0)] * comm.size
    widen = list(range(comm.size))  # the ranks that send (all at first)
    while True:
        mine = comm.rank in widen
        # (fewer than takes[r] when the partition has fewer nonzeros: never widened then)
        top = _top_magnitudes(part, takes[comm.rank]) if mine else None
        got, counts = comm.allgatherv(top if mine else get_array_module(part).zeros(0, np.float64))
        got = to_host(got)
        offs = np.concatenate(([0], np.cumsum(counts)))
        for r in widen:
            chunks[r] = got[offs[r] : offs[r + 1]]
        # a rank's NaN is among its top (the largest key), seen by every rank alike: all
        # raise, and no NaN becomes the threshold
        _agree_no_nan(np.array([[-1 if np.isnan(c).any() else 0] for c in chunks]))
        everything = np.concatenate(chunks)
        if everything.shape[0] == 0:
            return None, True
        kk = min(k, everything.shape[0])
        estimate = float(np.partition(everything, everything.shape[0] - kk)[-kk])
        widen = [
            r for r, c in enumerate(chunks) if c.shape[0] == takes[r] < k and c.min() >= estimate
        ]
        if not widen:
            return estimate, everything.shape[0] < k
        for r in widen:
            takes[r] = min(k, 2 * takes[r])
