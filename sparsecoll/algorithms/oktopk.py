"""oktopk: Ok-Topk sparse allreduce (Li & Hoefler, PPoPP'22): O(k) volume, state reused.

Each rank passes its locally selected entries (about k). One call, on every rank:
(1) on the first call, every ``tau_prime`` calls, and after a call whose regions went out of
balance (``imbalance``), [0, n) is cut into P regions balanced on every rank's index samples
(one small allgather); (2) counts by alltoall, then P−1 rotated steps send each region's
entries to its owner, who sums them; (3) the owner keeps its entries at or above the global
threshold: every ``tau`` calls the exact global k-th largest |value| (a distributed radix
select, one 256-bin allreduce per byte); in between the cut is re-placed on the call's data
among 65 edges around the last one (``rule="window"``) or reused and nudged (``"paper"``);
(4) the kept entries are rebalanced across ranks and allgathered (counts known).
Volume per rank: ≈ k(P−1)/P pairs each way in (2), K(P−1)/P received in (4), below 6k(P−1)/P
while regions are balanced; metadata: P counts (65 per rank on window calls). Latency ≈
2P + 2 log P messages. The walk-through and measurements: docs/guide/algorithms.md.

Contract: a recompute call (``info["recomputed"]``) keeps exactly the global top-k of the
reduced vector (ties to the lower index, zeros excepted); a window call (``info["window"] =
(lo, hi)``) exactly k: every |value| >= hi and, of those in [lo, hi) in index order, the
run from ``info["bucket_start"]`` (wrapping around) that completes k; a ``"paper"`` reuse
call every |value| >= ``info["threshold"]``. Values are the exact sums; the result is
identical on every rank, sorted, unique. ``result.contributed`` marks this rank's entries
whose index was kept (the rest go back to the residual).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from .. import _state
from .._array import get_array_module, to_host
from .._options import choice, count_band, flag, integer, real
from ..comm import Communicator, Request
from ..registry import register_algorithm
from ..select._common import key_info, key_value, magnitude_ge, magnitude_keys, threshold_key
from ..sparse import SparseVector
from ._merge import accumulate_dtype, isin_sorted, keep_bucket, merge_two
from ._partitions import balanced_boundaries, index_samples, sample_segments
from ._window import (
    bracket_edge,
    bucket_shares,
    bucket_start,
    edge_totals,
    nudged_up,
    window_edges,
)
from .base import (
    Algorithm,
    allclose_sparse,
    input_mass,
    pack_pairs,
    range_bounds,
    region_cuts,
    state_crc,
    unpack_pairs,
)  # fmt: skip
from .gtopk import check_k, topk_positions

__all__ = ["OkTopk"]

TAG_SPLIT = 41
TAG_BALANCE = 42
RULES = ("window", "paper")


@register_algorithm
class OkTopk(Algorithm):
    """Ok-Topk sparse allreduce with threshold and region reuse (see the module docstring).

    Pass the same instance to every call: it keeps the threshold, the region boundaries and
    the step counter. Every rank must make the same calls with equally built instances
    (checked collectively before each call).

    Args:
        k: global number of entries to keep (int >= 0).
        tau: recompute the global threshold exactly every ``tau`` calls (default 32, the
            authors' VGG/LSTM setting).
        tau_prime: recompute the region boundaries every ``tau_prime`` calls (default 64).
        imbalance: also recompute the region boundaries on the call after one in which a
            region received more than ``imbalance·k(P−1)/P`` pairs (default 2.0, a third of
            the volume bound; balanced regions receive about k(P−1)/P); None: only every
            ``tau_prime`` calls (the paper's schedule).
        rule: how the threshold is reused between recomputes: ``"window"`` (default: the
            cut re-placed on each call's data within a window of edges, exactly k kept) or
            ``"paper"`` (reused, nudged after calls whose count left ``band``).
        nudge: (``rule="paper"``) factor (>= 1) applied to a reused threshold when the kept
            count leaves the band (default 1.02).
        band: (``rule="paper"``) ``(low, high)`` fractions of k outside which the threshold
            is nudged (default (0.8, 1.25)).
        adaptive: (``rule="paper"``) grow the nudge while the count stays out of the band on
            one side (default True); False: the paper's fixed nudge.
    """

    name = "oktopk"
    exact = False
    required = ("k",)
    fixed_options: ClassVar[tuple[str, ...]] = (
        "k", "tau", "tau_prime", "nudge", "band", "adaptive", "rule", "imbalance",
    )  # fmt: skip
    state_kinds: ClassVar[dict[str, _state.Kind] | None] = {
        "step": _state.count,
        "threshold": _state.number,
        "streak": _state.signed,
        "window_misses": _state.count,
        "boundaries": _state.splits,
        "_shape": _state.problem,
        "_regions_from_data": _state.boolean,
        "_repartition_due": _state.boolean,
        "_trigger_rests": _state.boolean,
        "_over": _state.boolean,
        "_any_over": _state.boolean,
        "early_repartitions": _state.count,
    }

    def __init__(
        self,
        k: int | None = None,
        tau: int = 32,
        tau_prime: int = 64,
        nudge: float = 1.02,
        band: tuple[float, float] = (0.8, 1.25),
        adaptive: bool = True,
        rule: str = "window",
        imbalance: float | None = 2.0,
    ) -> None:
        self.k = check_k(self.name, k)
        if imbalance is not None:
            imbalance = real("imbalance", imbalance)
            if not imbalance > 0.0:  # (inf: never, as None)
                raise ValueError(f"imbalance must be a number > 0 or None, got {imbalance!r}")
        self.imbalance = imbalance
        self.rule = choice("rule", rule, RULES)
        self.adaptive = flag("adaptive", adaptive)
        self.tau, self.tau_prime = (
            integer("tau", tau, 1, int64=True),
            integer("tau_prime", tau_prime, 1, int64=True),
        )
        self.nudge = real("nudge", nudge)
        if not 1.0 <= self.nudge < math.inf:
            raise ValueError(f"nudge must be a finite number >= 1, got {nudge!r}")
        self.band = count_band("band", band)
        self.reset()

    def reset(self) -> None:
        """Forget the threshold, the regions and the step counter (the next call recomputes)."""
        self.step = 0
        self.threshold = 0.0
        self.streak = 0  # consecutive reuse calls out of the band: + above, - below
        self.window_misses = 0  # window calls that fell back to the exact select
        self.boundaries: np.ndarray | None = None
        self._shape: tuple[int, int] | None = None
        self._regions_from_data = False
        self._repartition_due = False  # a region went over the trigger: repartition next call
        self._trigger_rests = False  # went over on its own repartition call: wait for tau'
        self._over = False  # this rank's region went over the trigger on this call
        self._any_over = False  # some rank's did (from the flags of the counts gather)
        self.early_repartitions = 0  # repartitions the trigger brought forward

    @classmethod
    def default_options(cls, n: int, k: int) -> dict[str, Any]:
        return {"k": k}

    def check_state(self, saved: dict[str, Any], n: int, size: int) -> dict[str, Any]:
        state = super().check_state(saved, n, size)
        bounds = state["boundaries"]
        if bounds is not None and (state["_shape"] is None or int(bounds[-1]) != n):
            raise ValueError(
                f"the state's algorithm_state: oktopk's boundaries {bounds.tolist()} are no "
                f"regions of n={n} set up by a call"
            )
        return state

    def signature(self) -> list[int]:
        knobs = (self.rule, self.nudge, self.band, self.adaptive, self.imbalance)
        # with the state the calls left (every rank's alike: it comes from gathered data),
        # so that an instance used elsewhere (another n, P or stream) is an error on every
        # rank, not a rank resetting alone or reusing another threshold (a hang, or results
        # that differ); in the 4 values a GradientReducer compares
        state = (
            self._shape,
            self.threshold,
            self.streak,
            self._regions_from_data,
            self._repartition_due,
            self._trigger_rests,
        )
        crc = state_crc((knobs, state), self.boundaries)
        return [self.k, self.tau, self.tau_prime, crc, self.step]

    def next_threshold(self, threshold: float, kept: int) -> float:
        """The threshold after a reuse call that kept ``kept`` entries in all (updates the
        out-of-band streak)."""
        lo, hi = self.band
        side = 1 if kept > hi * self.k else -1 if kept < lo * self.k else 0
        if side == 0:
            self.streak = 0
            return threshold
        self.streak = self.streak + side if self.streak * side > 0 else side
        power = 2 ** min(abs(self.streak) - 1, 5) if self.adaptive else 1
        factor = self.nudge**power
        return nudged_up(threshold, factor) if side > 0 else threshold / factor

    def __repr__(self) -> str:
        return (
            f"<sparsecoll algorithm 'oktopk' k={self.k} tau={self.tau} "
            f"tau_prime={self.tau_prime} imbalance={self.imbalance} rule={self.rule!r} "
            f"step={self.step} threshold={self.threshold:g}>"
        )

    # -- one call --------------------------------------------------------------------------
    def reduce(self, comm: Communicator, x: SparseVector) -> SparseVector:
        n, size = x.n, comm.size
        if self._shape != (n, size):
            self.reset()
            self._shape = (n, size)
        scheduled = (
            self.boundaries is None
            or not self._regions_from_data
            or self.step % self.tau_prime == 0
        )
        early = self._repartition_due and not scheduled
        repartition = scheduled or early
        self._repartition_due = False
        if repartition:
            self._trigger_rests = False
            self.early_repartitions += early
            rows = comm.allgather_ints(index_samples(to_host(x.indices), sample_segments(size)))
            self.boundaries = balanced_boundaries(rows, n, size)
            self._regions_from_data = bool(np.any(rows[:, 0] > 0))
        bounds = self.boundaries
        region, own, incoming = self._split_reduce(comm, x, bounds)
        # the flag this rank's counts gather (step 3) carries; _gather_counts ORs them all
        # (k = 0: the bound is 0, and no repartition brings the volume down to it)
        trigger = None if self.imbalance is None or not self.k else self.imbalance * self.k
        self._over = trigger is not None and incoming > trigger * (size - 1) / size
        self._any_over = False
        # a NaN threshold (inf + -inf at the k-th place) is recomputed like 0; k = 0 always
        # is: its exact select keeps nothing, at a threshold of NaN that no value meets
        recompute = self.step % self.tau == 0 or not self.threshold > 0.0 or not self.k
        missed = False
        window = None
        kept = None  # (indices, values) kept in this rank's region
        chosen = None  # which of the region's entries were kept (a mask)
        start = None  # where a window call began taking its bucket
        if not recompute and self.rule == "window":
            picked = self._select_window(comm, *region)
            missed = recompute = picked is None
            if picked is not None:
                *kept, chosen, kept_counts, window, start = picked
                threshold = self.threshold = window[0]
        elif not recompute:
            threshold = self.threshold
            keep = _at_least(region[1], threshold)
            kept_counts = self._gather_counts(comm, [int(keep.shape[0])])[:, 0].tolist()
            self.threshold = self.next_threshold(threshold, int(sum(kept_counts)))
        if recompute:
            keep, kept_counts, threshold = self._select_exact(comm, region[1])
            self.threshold = threshold
            self.streak = 0
            self.window_misses += missed
        if kept is None:
            kept = (region[0][keep], region[1][keep])
            if own is not None:
                chosen = x.xp.zeros(region[0].shape[0], dtype=bool)
                chosen[keep] = True
        total = int(sum(kept_counts))
        idx, vals = self._balance_gather(comm, *kept, kept_counts)
        unbalanced = self._any_over
        if unbalanced and repartition:  # regions of this call's own indices: no remedy
            self._trigger_rests = True
        elif unbalanced and not self._trigger_rests:
            self._repartition_due = True
        out = SparseVector(idx, vals, n)
        out.contributed = _contributed(x, idx, bounds, comm.rank, own, chosen)
        out.local = x
        out.info.update(
            k=self.k,
            step=self.step,
            threshold=threshold,
            next_threshold=self.threshold,
            recomputed=recompute,
            window=window,
            bucket_start=start,
            window_missed=missed,
            repartitioned=repartition,
            early_repartition=early,
            unbalanced=unbalanced,
            boundaries=bounds.copy(),
            kept=total,
        )
        self.step += 1
        return out

    def _split_reduce(
        self, comm: Communicator, x: SparseVector, bounds: np.ndarray
    ) -> tuple[Any, Any, int]:
        """Step (2): send each region's entries to its owner; sum what arrives into own region.

        Returns the region's (indices, values), when no other rank sent into it (as at
        P = 1) the slice of x it is (else None), and how many pairs it received."""
        xp, r, size = x.xp, comm.rank, comm.size
        cuts = region_cuts(x.indices, bounds)
        sendcounts = [cuts[j + 1] - cuts[j] for j in range(size)]
        recvcounts = comm.alltoall_ints(sendcounts) if size > 1 else sendcounts
        acc_type = accumulate_dtype(x.dtype)
        itype, vtype = x.indices.dtype, x.dtype
        pair = itype.itemsize + vtype.itemsize
        sends: list[Request] = []
        recvs: dict[int, tuple[Request, Any]] = {}
        for s in range(1, size):
            src = (r - s) % size
            if recvcounts[src]:
                buf = xp.empty(recvcounts[src] * pair, dtype=np.uint8)
                recvs[src] = (comm.irecv(buf, src, TAG_SPLIT), buf)
        for s in range(1, size):
            dst = (r + s) % size
            if sendcounts[dst]:
                lo, hi = cuts[dst], cuts[dst + 1]
                sends.append(
                    comm.isend(pack_pairs(x.indices[lo:hi], x.values[lo:hi]), dst, TAG_SPLIT)
                )
        acc_idx = x.indices[cuts[r] : cuts[r + 1]]
        acc_val = x.values[cuts[r] : cuts[r + 1]].astype(acc_type, copy=False)
        for s in range(1, size):  # a fixed order: the sums do not depend on arrival times
            src = (r - s) % size
            if src not in recvs:
                continue
            req, buf = recvs[src]
            req.wait()
            ci, cv = unpack_pairs(buf, itype, vtype)
            # both runs are sorted and unique: one linear merge (acc + cv at equal indices)
            acc_idx, acc_val = merge_two(acc_idx, acc_val, ci, cv.astype(acc_type), x.n)
        Request.waitall(sends)
        own = None if recvs else (cuts[r], cuts[r + 1])
        incoming = sum(recvcounts) - recvcounts[r]
        return (acc_idx, acc_val.astype(vtype, copy=False)), own, incoming

    def _gather_counts(self, comm: Communicator, row: list[int] | np.ndarray) -> np.ndarray:
        """The (P, m) table of every rank's ``row`` of counts (ints >= 0): the one gather
        of per-rank counts that step (3) makes on every path. It carries, at no extra byte,
        whether this rank's region received more than the imbalance trigger (``row[0]``
        sent as ``~row[0]``, negative), and records whether any rank's did."""
        row = np.array(row, dtype=np.int64)
        if self._over:
            row[0] = ~row[0]
        table = comm.allgather_ints(row)
        flags = table[:, 0] < 0
        table[flags, 0] = ~table[flags, 0]
        self._any_over |= bool(flags.any())
        return table

    def _select_window(
        self, comm: Communicator, idx: Any, vals: Any
    ) -> tuple[Any, Any, Any, list[int], tuple[float, float], int] | None:
        """Step (3) on a reuse call with ``rule="window"``: k entries, cut at the edges around
        the last threshold that bracket the global k-th largest |value| (one allgather of E
        counts per rank, no other message).

        Keeps every |value| >= ``hi`` and, of those in ``[lo, hi)`` in index order, a run
        from position :func:`bucket_start` on (wrapping around) up to k in all. Returns
        the kept indices and values of this rank's region ``(idx, vals)``, which of its
        entries were kept (a mask), every rank's kept count, ``(lo, hi)`` and the bucket's
        start; None (on every rank: they all see the same counts) when k lies outside the
        window.
        """
        # compare in the values' dtype (counts == selections); an edge that rounds to 0
        # must not select zeros
        tiny = np.finfo(vals.dtype).smallest_subnormal
        edges = np.maximum(window_edges(self.threshold, vals.dtype), tiny)
        if comm.size == 1 and vals.shape[0] == self.k:
            return self._window_keeping_all(idx, vals, edges)
        return self._window_counted(comm, idx, vals, edges)

    def _window_counted(
        self, comm: Communicator, idx: Any, vals: Any, edges: np.ndarray
    ) -> tuple[Any, Any, Any, list[int], tuple[float, float], int] | None:
        """:meth:`_select_window` from every rank's count at every edge."""
        table = self._gather_counts(comm, edge_totals(vals, edges))
        j = bracket_edge(table.sum(axis=0), self.k)
        if j is None:
            return None
        # m: the edge all of whose entries are kept (j itself when exactly k are at the
        # highest edge: no bucket to cut)
        top = j + 1 == edges.shape[0]
        m = j if top else j + 1
        above = table[:, m]
        bucket = table[:, j] - above  # per rank, in [lo, hi)
        # the bucket's entries in index order (regions are in index order by rank): the
        # need of them from position start on, wrapping around, so no index range always
        # loses the bucket (start moves with the call)
        need = self.k - int(above.sum())
        total = int(bucket.sum())
        start = bucket_start(self.step, total)
        shares = bucket_shares(bucket, need, start)
        taken = np.array([sum(b - a for a, b in share) for share in shares], dtype=np.int64)
        hi = float("inf") if top else float(edges[m])
        counts = (above + taken).tolist()
        assert sum(counts) == self.k, (counts, self.k)
        # all from edges[m] up, and this rank's share of the bucket [edges[j], edges[m])
        mine = shares[comm.rank]
        kept = keep_bucket(idx, vals, edges[m], edges[j], mine, counts[comm.rank], mask=True)
        return *kept, counts, (float(edges[j]), hi), start

    def _window_keeping_all(
        self, idx: Any, vals: Any, edges: np.ndarray
    ) -> tuple[Any, Any, Any, list[int], tuple[float, float], int] | None:
        """:meth:`_select_window` where one rank's region holds exactly k entries (as at
        P = 1 after the caller's local top-k): the same answer without a count at every
        edge or a keep pass. Whatever the window gives, all k entries are kept; the edges
        are those the counts would give: j, the highest edge at or below the smallest
        |value| (every entry is >= it, the smallest is below the next), and the bucket
        [edges[j], edges[j + 1]) is taken whole, from where :func:`bucket_start` puts it."""
        xp = get_array_module(vals)
        # the least |value| on keys (CuPy's abs and min flush float32 subnormals to 0); a
        # NaN (never counted) reads as key 0, so it fails the test below as a zero does
        info = key_info(vals.dtype)
        keys = magnitude_keys(vals)
        ut = info.utype.type
        least_key = int(xp.where(keys <= ut(info.inf_key), keys, ut(0)).min())
        least = key_value(least_key, vals.dtype)  # (exactly the value in vals' dtype)
        if not least >= edges[0]:  # fewer than k entries >= the lowest edge
            return None
        j = int(np.searchsorted(edges, least, side="right")) - 1
        top = j + 1 == edges.shape[0]
        hi = float("inf") if top else float(edges[j + 1])
        bucket = 0 if top else self.k - int(xp.count_nonzero(magnitude_ge(vals, edges[j + 1])))
        start = bucket_start(self.step, bucket)
        # the result must not share memory with the caller's input (as the keep's copy)
        chosen = xp.ones(vals.shape[0], dtype=bool)
        return idx.copy(), vals.copy(), chosen, [self.k], (float(edges[j]), hi), start

    def _select_exact(self, comm: Communicator, vals: Any) -> tuple[Any, list[int], float]:
        """Step (3) on a recompute call: the exact global top-k (ties by lower index).

        Returns the kept positions in this rank's region, every rank's kept count and the
        threshold (the k-th largest |value|, or the smallest nonzero one when at most k
        entries are nonzero; 0 when none is; NaN at k = 0, which no value meets).
        """
        xp = get_array_module(vals)
        if self.k == 0:
            return xp.zeros(0, dtype=np.int64), [0] * comm.size, math.nan
        # the bits of a non-negative float order like it (not xp.abs: CuPy's flushes float32
        # subnormals to 0, so they would count as zeros)
        keys = magnitude_keys(vals)
        found = _radix_kth(comm, keys[keys > 0], self.k, 8 * vals.dtype.itemsize, xp)
        if found is None:  # at most k nonzeros in all: keep them all
            keep = xp.flatnonzero(keys)
            least = int(keys[keep].min()) if keep.shape[0] else -1
            rows = self._gather_counts(comm, [int(keep.shape[0]), least])
            live = rows[:, 1][rows[:, 1] >= 0]
            smallest = key_value(int(live.min()) if live.size else 0, vals.dtype)
            return keep, rows[:, 0].tolist(), smallest
        key, ties_needed = found
        above = keys > key
        tie_pos = xp.flatnonzero(keys == key)
        ge = self._gather_counts(comm, [int(xp.count_nonzero(above)), int(tie_pos.shape[0])])
        # regions are in index order by rank, so ties go to the lowest ranks' lowest indices
        before = np.concatenate(([0], np.cumsum(ge[:-1, 1])))
        taken = np.clip(ties_needed - before, 0, ge[:, 1])
        above[tie_pos[: int(taken[comm.rank])]] = True  # the union, ascending, with no sort
        keep = xp.flatnonzero(above)
        counts = (ge[:, 0] + taken).tolist()
        assert sum(counts) == self.k, (counts, self.k)
        return keep, counts, key_value(int(key), vals.dtype)

    def _balance_gather(
        self, comm: Communicator, idx: Any, vals: Any, counts: list[int]
    ) -> tuple[Any, Any]:
        """Step (4): move kept entries so every rank holds an equal share, then allgatherv."""
        size, r = comm.size, comm.rank
        xp = get_array_module(vals)
        if size == 1:
            return idx, vals
        total = sum(counts)
        held = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)  # positions held
        target = range_bounds(total, size)  # positions each rank holds after balancing

        def overlap(src: int, dst: int) -> tuple[int, int]:
            lo = max(held[src], target[dst])
            hi = min(held[src + 1], target[dst + 1])
            return int(lo), int(max(lo, hi))

        pair = idx.dtype.itemsize + vals.dtype.itemsize
        sends: list[Request] = []
        recvs: list[tuple[int, Request, Any]] = []
        for s in range(1, size):
            src = (r - s) % size
            lo, hi = overlap(src, r)
            if hi > lo:
                buf = xp.empty((hi - lo) * pair, dtype=np.uint8)
                recvs.append((src, comm.irecv(buf, src, TAG_BALANCE), buf))
        for s in range(1, size):
            dst = (r + s) % size
            lo, hi = overlap(r, dst)
            if hi > lo:
                a, b = lo - int(held[r]), hi - int(held[r])
                sends.append(comm.isend(pack_pairs(idx[a:b], vals[a:b]), dst, TAG_BALANCE))
        lo, hi = overlap(r, r)
        pieces = {r: (idx[lo - held[r] : hi - held[r]], vals[lo - held[r] : hi - held[r]])}
        for src, req, buf in recvs:
            req.wait()
            ci, cv = unpack_pairs(buf, idx.dtype, vals.dtype)
            pieces[src] = (ci, cv.copy())
        Request.waitall(sends)
        order = sorted(pieces)  # source ranks in order = index order
        my_idx = xp.concatenate([pieces[s][0] for s in order])
        my_val = xp.concatenate([pieces[s][1] for s in order])
        share = np.diff(target).tolist()
        assert my_idx.shape[0] == share[r]
        return _allgather_pairs(comm, my_idx, my_val, share)

    def verify(
        self, result: SparseVector, reference: SparseVector, inputs: list[SparseVector]
    ) -> bool:
        """Kept values equal the reference there, none of them 0, and the kept set is the
        call's: on a recompute call the top-k of the reference (up to rounding at
        near-ties); on a window call (``info["window"] = (lo, hi)``) exactly k, every
        |sum| >= hi and none below lo; on a ``rule="paper"`` reuse call every |sum| >= the
        threshold in force and none below it. A sum not kept is compared with the reference,
        which may differ from the owner's sum by rounding: within that, it is let pass."""
        ri = np.asarray(to_host(result.indices)).astype(np.int64)
        fi = np.asarray(to_host(reference.indices)).astype(np.int64)
        fv = np.asarray(to_host(reference.values)).astype(np.float64)
        if ri.shape[0] and not np.all(isin_sorted(ri, fi)):
            return False
        at = np.searchsorted(fi, ri)
        if not allclose_sparse(result, SparseVector(ri, fv[at], reference.n), inputs):
            return False
        kept = np.abs(np.asarray(to_host(result.values), np.float64))
        if np.any(kept == 0):
            return False
        dropped = np.ones(fi.shape[0], dtype=bool)
        dropped[at] = False
        info = result.info
        if not info.get("recomputed"):
            window = info.get("window")
            low, high = window if window is not None else (info["threshold"],) * 2
            if window is not None and ri.shape[0] != self.k:
                return False
            eps = float(np.finfo(result.values.dtype).eps)
            slack = len(inputs) * eps * input_mass(inputs, fi[dropped])
            return bool(np.all(kept >= low) and np.all(np.abs(fv[dropped]) < high + slack))
        if ri.shape[0] != topk_positions(fv, self.k).shape[0]:
            return False
        worst_dropped = np.abs(fv[dropped]).max(initial=0.0)
        least_kept = np.abs(fv[at]).min(initial=np.inf)
        eps = float(np.finfo(result.values.dtype).eps)
        return bool(worst_dropped <= least_kept * (1 + 64 * eps * len(inputs)))


def _contributed(
    x: SparseVector, idx: Any, bounds: np.ndarray, rank: int, own: Any, chosen: Any
) -> Any:
    """Which of x's entries made the result ``idx`` (ascending). Where this rank's region is
    a slice of x (``own``, no other rank sent into it) ``chosen`` says so already; the rest
    is one walk over x's indices and the result's."""
    if own is None:
        return isin_sorted(x.indices, idx)
    lo, hi = own
    a, b = region_cuts(idx, bounds)[rank : rank + 2]  # the result's part in this region
    out = x.xp.empty(x.nnz, dtype=bool)
    out[:lo] = isin_sorted(x.indices[:lo], idx[:a])
    out[lo:hi] = chosen
    out[hi:] = isin_sorted(x.indices[hi:], idx[b:])
    return out


def _at_least(vals: Any, threshold: float) -> Any:
    """Positions with |value| >= threshold (a positive threshold, compared in float64)."""
    xp = get_array_module(vals)
    if xp is np:
        return xp.flatnonzero(xp.abs(vals) >= np.float64(threshold))
    # on keys (CuPy's abs and compare flush float32 subnormals): key >= threshold_key(t)
    # is exactly |value| >= t in float64
    info = key_info(vals.dtype)
    keys, ut = magnitude_keys(vals), info.utype.type
    tkey = ut(threshold_key(float(threshold), vals.dtype))
    return xp.flatnonzero((keys >= tkey) & (keys <= ut(info.inf_key)))


def _allgather_pairs(comm: Communicator, idx: Any, vals: Any, counts: list[int]) -> tuple[Any, Any]:
    """One allgatherv of every rank's (indices, values), counts known on every rank.

    Each rank's part is its index bytes, padded to 8 bytes, then its value bytes, padded to
    8 bytes: every view stays aligned. Indices stay integers (no float-packed ints).
    """
    xp = get_array_module(vals)
    isz, vsz = idx.dtype.itemsize, vals.dtype.itemsize

    def pad(b: int) -> int:
        return -(-b // 8) * 8

    sizes = [pad(c * isz) + pad(c * vsz) for c in counts]
    mine = xp.zeros(sizes[comm.rank], dtype=np.uint8)
    head = pad(idx.shape[0] * isz)
    mine[: idx.nbytes] = idx.view(np.uint8)
    mine[head : head + vals.nbytes] = vals.view(np.uint8)
    buf, _ = comm.allgatherv(mine, sizes)
    starts = np.concatenate(([0], np.cumsum(sizes)))
    parts_i, parts_v = [], []
    for r, c in enumerate(counts):
        if c:
            lo, mid = int(starts[r]), int(starts[r]) + pad(c * isz)
            parts_i.append(buf[lo : lo + c * isz].view(idx.dtype))
            parts_v.append(buf[mid : mid + c * vsz].view(vals.dtype))
    if not parts_i:
        return idx[:0].copy(), vals[:0].copy()
    return xp.concatenate(parts_i), xp.concatenate(parts_v)


def _radix_kth(comm: Communicator, keys: Any, k: int, bits: int, xp: Any) -> tuple[Any, int] | None:
    """The k-th largest key over every rank (one 256-bin histogram allreduce per byte).

    Returns ``(key, ties)``: ``ties`` of the entries equal to ``key`` complete the top k;
    None when there are at most k keys in all (the first histogram counts them).
    """
    prefix = 0
    need = k
    cand = keys
    for shift in range(bits - 8, -1, -8):
        digits = ((cand >> shift) & 0xFF).astype(np.int64)
        hist = to_host(xp.bincount(digits, minlength=256))
        ghist = comm.allreduce_ints(hist)
        if shift == bits - 8 and int(ghist.sum()) <= k:
            return None
        from_top = np.cumsum(ghist[::-1])
        j = int(np.searchsorted(from_top, need))  # first bin (from the top) reaching need
        b = 255 - j
        need -= int(from_top[j] - ghist[b])
        prefix = (prefix << 8) | b
        cand = cand[digits == b]
    return keys.dtype.type(prefix), need
