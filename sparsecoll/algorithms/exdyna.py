"""exdyna: the ExDyna sparsifier (Yoon & Oh, 2024) with a per-call threshold window.

A sparsifier over each rank's dense accumulated gradient, not a reduction of arbitrary
sparse inputs. [0, n) is cut into fine-grained blocks grouped into P partitions; at call t
rank r selects |a| >= threshold only in partition (t + r) mod P, so selections never
overlap. The threshold: every rank counts its candidates at 65 edges around the current
one and one allgather of those counts gives every rank the global count at each; all pick
the edge nearest k (a tie bucket is cut in index order to keep exactly k). When k lies
outside the window the threshold is re-derived exactly from the ranks' top magnitudes
(O(k) in all). Then one allgatherv of the selected indices (counts known) and one dense
allreduce of the K values give the exact sums; boundary blocks move between neighbouring
partitions whose counts straddle the mean (``rebalance``). ``rule="authors"``: the
authors' nudging rule instead, for comparison.
Volume per rank: K(P−1)/P indices received, an allreduce of K values, 65 counts per rank;
three collectives a call (two more per re-derive round). Walk-through: docs/guide/algorithms.md.

Contract: the result holds the selected indices, sorted, the union of disjoint
per-partition selections, each with the exact sum of every rank's input there, identical
on every rank; ``result.contributed`` marks this rank's entries at selected indices.
``result.info``: ``threshold`` (NaN at k = 0), ``counts`` (per partition), ``selected``,
``rederived``, ``bucket`` (``(lo, hi, start)`` when a tie was cut: every |value| >= hi and
the run of [lo, hi) from ``start`` completing k), ``owners`` and ``ranges`` (each
partition's selecting rank and index range on this call).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from .. import _state, select
from .._array import get_array_module, index_dtype, to_host
from .._options import choice, flag, integer, real
from ..comm import Communicator
from ..errors import CollectiveInputError
from ..registry import register_algorithm
from ..sparse import SparseVector
from ._exdyna_threshold import (
    _agree_no_nan,
    _below_needed,
    _Bucket,
    _count_nonzeros,
    _cut,
    _edges,
    _Found,
    authors_rule,
    derive_threshold,
)
from ._merge import gather
from ._partitions import rebalance
from ._window import (
    WINDOW_OFFSETS,
    bracket_edge,
    bucket_shares,
    bucket_start,
    edge_totals,
    pick_edge,
)
from .base import Algorithm, allclose_sparse, range_bounds, region_cuts, search_sorted, state_crc
from .gtopk import check_k

__all__ = ["ExDyna"]

RULES = ("window", "authors")
COOLDOWN = 16  # calls between re-derives while k stays outside the window
# The window edge from which a caller's candidates (reduce_dense) are counted: the
# threshold's expected log-change (its smoothed growth) less a margin, MARGIN plus three
# times its smoothed deviation from that growth (the swing). Below that edge the counts come
# from a second read of the data, only when the pick needs them. After a re-derive the swing
# starts at SWING0: the candidates start at edge 16 (thr·e^-0.064, about 2k candidates on
# Gaussian data at 1%); on a settled stream (the same pick call after call) they start at
# e^-0.012, about 1.1k (_candidate_edge).
CANDIDATE_EDGE = 16
MARGIN = 0.012
SWING0 = (-float(WINDOW_OFFSETS[CANDIDATE_EDGE]) - MARGIN) / 3


def _above(x: Any, t: float) -> _Found | None:
    """The entries with |x| >= t (t > 0: zeros are never selected), or None when x holds
    a NaN (the caller shares that verdict collectively)."""
    try:
        pos, vals = select.threshold(x, t)
    except ValueError:
        return None
    return _Found(vals, pos)


@register_algorithm
class ExDyna(Algorithm):
    """ExDyna sparsifier-allreduce (see the module docstring). Keeps state between calls:
    pass the same instance to every call, on every rank.

    Args:
        k: the global number of entries to select per call (int >= 0).
        blocks: number of fine-grained blocks (default ``max(1024, 32·P)``, at most n).
        rule: ``"window"`` (default, per-call threshold window) or ``"authors"``.
        rebalance: move blocks between neighbouring partitions after each call.
        tolerance: the rebalancing band around the mean count (default 0.05).
    """

    name = "exdyna"
    exact = False
    required = ("k",)
    fixed_options: ClassVar[tuple[str, ...]] = ("k", "blocks", "rule", "rebalance", "tolerance")
    state_kinds: ClassVar[dict[str, _state.Kind] | None] = {
        "step": _state.count,
        "n": _state.length,
        "size": _state.ranks,
        "block_size": _state.count,
        "bounds": _state.splits,
        "threshold": _state.optional(_state.number),
        "growth": _state.number,
        "swing": _state.number,
        "trend_calls": _state.count,
        "rederives": _state.count,
        "recounts": _state.count,
        "_cooldown": _state.count,
        "_cooldown_side": _state.signed,
    }

    def __init__(
        self,
        k: int | None = None,
        blocks: int | None = None,
        rule: str = "window",
        rebalance: bool = True,
        tolerance: float = 0.05,
    ) -> None:
        self.k = check_k(self.name, k)
        self.blocks = None if blocks is None else integer("blocks", blocks, 1, int64=True)
        self.rule = choice("rule", rule, RULES)
        self.rebalance = flag("rebalance", rebalance)
        self.tolerance = real("tolerance", tolerance)
        if not 0.0 <= self.tolerance < 1.0:
            raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
        self.reset()

    def reset(self) -> None:
        """Forget the state (threshold, partitions, call counter)."""
        self.step = 0
        self.n: int | None = None
        self.size: int | None = None
        self.block_size = 0
        self.bounds: np.ndarray | None = None  # P + 1 block boundaries
        self.threshold: float | None = None
        self.growth = 0.0  # the threshold's smoothed log-change per call (for zero_cut)
        self.swing = SWING0  # its smoothed deviation from that (for _candidate_edge)
        self.trend_calls = 0  # calls that growth has followed since it was last reset
        self.rederives = 0
        self.recounts = 0  # calls whose candidates did not reach low enough: a second read
        self._cooldown = 0
        self._cooldown_side = 0  # the miss that started the cooldown: +1 too many, -1 too few

    @classmethod
    def default_options(cls, n: int, k: int) -> dict[str, Any]:
        return {"k": k}

    def signature(self) -> list[int]:
        # rebalance and tolerance move the partition bounds: ranks that differ in them
        # would own overlapping ranges (repeated indices) or leave gaps
        # and the state the calls left (every rank's alike: it comes from gathered data),
        # so that an instance set up elsewhere (another n, P or stream) is an error on every
        # rank, not a rank raising alone or selecting from another partition (a hang)
        knobs = (self.rule, self.rebalance, self.tolerance)
        state = (self.n, self.size, self.block_size, self.threshold, self.growth, self.swing)
        crc = state_crc((knobs, state, self.trend_calls), self.bounds)
        return [self.k, self.blocks or 0, self.step & 0x7FFFFFFF, crc]

    # -- partitions -------------------------------------------------------------------------
    def prepare(self, comm: Communicator, n: int) -> None:
        """Set up the blocks and partitions for length ``n`` on ``comm`` (the first call
        does it; calling it first lets :meth:`owned_range` answer before any call)."""
        if self.n is None:
            p = comm.size
            bs, nblocks = self._blocks(n, p)
            self.n, self.size, self.block_size = n, p, bs
            self.bounds = range_bounds(nblocks, p)
        elif n != self.n or comm.size != self.size:
            # (on every rank alike: n, and the n and size set up, agreed in the signature)
            raise CollectiveInputError(
                f"exdyna was set up for n={self.n} on {self.size} ranks, got n={n} on "
                f"{comm.size}: call its reset() on every rank first (it forgets the "
                f"partitions and the threshold), or use a new instance for this n or "
                f"communicator"
            )

    def _blocks(self, n: int, p: int) -> tuple[int, int]:
        """The block size and the number of blocks for length ``n`` on ``p`` ranks."""
        target = min(max(n, 1), self.blocks or max(1024, 32 * p))
        bs = -(-max(n, 1) // target)
        if bs >= 32:
            bs = -(-bs // 32) * 32
        return bs, -(-n // bs)

    def check_state(self, saved: dict[str, Any], n: int, size: int) -> dict[str, Any]:
        state = super().check_state(saved, n, size)
        layout = (state["n"], state["size"], state["block_size"])
        if state["n"] is None:
            fits = layout == (None, None, 0) and state["bounds"] is None
        else:
            bs, nblocks = self._blocks(n, size)
            bounds = state["bounds"]
            fits = state["block_size"] == bs and bounds is not None and bounds[-1] == nblocks
        if not fits:
            bounds = None if state["bounds"] is None else state["bounds"].tolist()
            raise ValueError(
                f"the state's algorithm_state: exdyna's partitions (n, ranks, block size "
                f"{layout}, bounds {bounds}) are not those it sets up for n={n} on {size} ranks"
            )
        return state

    def _partition(self, rank: int) -> int:
        """The partition ``rank`` selects from at the current call."""
        return (self.step + rank) % self.size

    def _owners(self) -> list[int]:
        """The rank that selects from each partition at the current call (partitions in
        index order): the inverse of :meth:`_partition`."""
        return [(q - self.step) % self.size for q in range(self.size)]

    def owned_range(self, rank: int) -> tuple[int, int]:
        """The index range ``[lo, hi)`` that ``rank`` selects from at the current call."""
        p = self._partition(rank)
        bs, n = self.block_size, self.n
        return min(int(self.bounds[p]) * bs, n), min(int(self.bounds[p + 1]) * bs, n)

    # -- entry points ---------------------------------------------------------------------
    def reduce(self, comm: Communicator, x: SparseVector) -> SparseVector:
        n, xp = x.n, x.xp
        self.prepare(comm, n)
        lo, hi = self.owned_range(comm.rank)
        a, b = search_sorted(x.indices, [lo, hi])
        part_idx = x.indices[a:b]

        def values_at(idx: Any) -> Any:
            if x.nnz == 0:
                return xp.zeros(idx.shape[0], x.dtype)
            pos = xp.minimum(xp.searchsorted(x.indices, idx), x.nnz - 1)
            hit = x.indices[pos] == idx
            return xp.where(hit, x.values[pos], xp.zeros((), x.dtype))

        out = self._run(comm, n, x.values[a:b], lambda pos: part_idx[pos], values_at, x.dtype, xp)
        if out.nnz and x.nnz:
            pos = xp.minimum(xp.searchsorted(out.indices, x.indices), out.nnz - 1)
            out.contributed = out.indices[pos] == x.indices
        else:
            out.contributed = xp.zeros(x.nnz, dtype=bool)
        out.local = x
        return out

    def candidate_cut(self, dtype: Any) -> float | None:
        """A |value| from which the next call's selection usually lies (None when it will
        derive its threshold from the data): a caller that collects the entries of its
        owned range at or above it, in a pass it makes anyway, can hand them to
        :meth:`reduce_dense` (which reads the range again itself when the window's counts
        below it are needed)."""
        if self.threshold is None:
            return None
        if self.rule == "authors":
            return _cut(dtype, self.threshold)
        return _cut(dtype, float(_edges(self.threshold, dtype)[self._candidate_edge()]))

    def _candidate_edge(self) -> int:
        """The window edge from which a caller's candidates start: the one at or below the
        threshold's expected log-change (its smoothed growth) less MARGIN and three times
        its smoothed swing. A pick below the candidates costs a second read of the range;
        candidates far below it cost their count and take, about 1.5 ns each."""
        want = self.growth - MARGIN - 3 * self.swing + 1e-12  # (edge 16 after a re-derive)
        j = int(np.searchsorted(WINDOW_OFFSETS, want, side="right")) - 1
        return min(max(j, 0), WINDOW_OFFSETS.shape[0] - 1)

    def counts_nonzeros(self) -> bool:
        """Whether the next call counts the nonzeros of its owned range (while a cooldown
        after a miss low holds, see :meth:`_window`): a caller whose pass reads the range
        anyway can count them there and hand the count to :meth:`reduce_dense`
        (``nonzeros=``), sparing the call a read of the range."""
        return self.rule == "window" and self._counting(max(0, self._cooldown - 1))

    def _counting(self, cooldown: int) -> bool:
        """Whether a call with ``cooldown`` calls left (after its own) counts nonzeros."""
        return bool(cooldown) and self._cooldown_side < 0

    def zero_cut(self, dtype: Any) -> float | None:
        """Where the next call's selection is expected to start (None when it will derive
        a threshold): the current threshold, moved by its smoothed change per call and
        kept inside the window, as ``dtype`` holds it. A caller whose pass collects the
        candidates can also take those at or above it out of ``acc`` in that pass
        (``reduce_dense(zeroed=...)``), sparing the scattered zeroing that ``drop`` does;
        the nearer the selection's actual cut, the fewer entries are given back."""
        if self.threshold is None:
            return None
        if self.rule == "authors":
            return _cut(dtype, self.threshold)
        ahead = self.threshold * math.exp(self.growth)
        window = _edges(self.threshold, dtype)
        low = float(window[self._candidate_edge()])
        return _cut(dtype, min(max(ahead, low), float(window[-1])))

    def reduce_dense(
        self,
        comm: Communicator,
        acc: Any,
        candidates: tuple[Any, Any] | None = None,
        drop: bool = False,
        zeroed: float | None = None,
        mean: bool = False,
        nonzeros: int | None = None,
    ) -> SparseVector:
        """Select from this rank's dense accumulated gradient ``acc`` and reduce.

        The same as :meth:`reduce` given all n entries of ``acc``, without building them.
        Every rank must call it with an array of the same length and dtype. The caller's
        residual drops all ``result.indices`` (every rank contributed its value there).
        ``candidates``: ``(indices, values)`` of every entry of the owned range with |value|
        at or above :meth:`candidate_cut` (ascending, global indices), found by the caller;
        the call then reads only those, not the owned range (unless it must re-derive, or
        the window's pick needs counts below the candidates: then every rank reads its
        range again, on the same call). ``drop``: set ``acc`` to 0 at every index of the
        result (what the caller's error feedback does next), in the loop that reads the
        values there; ``acc`` is then changed even when the call raises after that loop.
        ``zeroed`` (with ``candidates`` and ``drop``): the caller's pass has already set
        ``acc`` to 0 at the candidates with |value| >= zeroed (a cut at or above
        :meth:`candidate_cut`, e.g. :meth:`zero_cut`): their values are the candidates'.
        The call gives back those it does not select, zeroes those it selects below the
        cut, and takes the values of this rank's own range from the candidates: no
        scattered read or write of ``acc`` in the owned range. ``acc`` is whole again if
        the call must read its range itself. ``mean``: the result's values are divided by
        the number of ranks, in the precision they are summed in (float32 for float16, so
        an average that fits in float16 comes back where the sum would overflow it).
        ``nonzeros``: how many entries of the owned range are not 0 (before the caller's
        pass zeroed any: ``zeroed``), counted by the caller in a pass it makes anyway
        (``select.accumulate(nonzeros=True)``), for a call that needs them
        (:meth:`counts_nonzeros`); None: the call counts them itself when it does. The
        caller vouches that the range holds no NaN (its pass flags them).
        """
        n = int(acc.shape[0])
        self.prepare(comm, n)
        lo, hi = self.owned_range(comm.rank)
        itype = index_dtype(n)
        xp = get_array_module(acc)

        def to_index(pos: Any) -> Any:
            return xp.add(pos, lo, dtype=itype)  # one pass: no int64 temporary

        if zeroed is not None and (candidates is None or not drop):
            raise ValueError("zeroed needs the candidates and drop=True")
        found = None
        part = acc[lo:hi]
        if candidates is not None:
            idx, vals = candidates
            idx = idx.astype(itype, copy=False)  # (every rank sends the same index dtype)
            low = self._candidate_edge() if self.rule == "window" else 0
            found = _Found(vals, idx, lo, low, part, zeroed, given=True)

        def values_at(idx: Any) -> Any:
            if found is None or found.taken is None:
                return gather(acc, idx, drop)
            # this rank's own range is a run of idx, its values the candidates' (taken); (hi
            # may be n = 2**31, which int32 indices do not hold: region_cuts searches wider)
            a, b = region_cuts(idx, np.array([0, lo, hi, n], dtype=np.int64))[1:3]
            if a == 0 and b == idx.shape[0]:
                return found.taken
            out = xp.empty(idx.shape[0], acc.dtype)
            out[:a] = gather(acc, idx[:a], drop)
            out[a:b] = found.taken
            out[b:] = gather(acc, idx[b:], drop)
            return out

        return self._run(comm, n, part, to_index, values_at, acc.dtype, xp, found, mean, nonzeros)

    # -- the call ---------------------------------------------------------------------------
    def _run(
        self, comm, n, part, to_index, values_at, dtype, xp, found=None, mean=False,
        nonzeros=None,
    ) -> SparseVector:  # fmt: skip
        p = comm.size
        owner = self._owners()
        # this call's partitions, in index order: who selects from each, and its range
        layout = dict(owners=owner, ranges=[self.owned_range(r) for r in owner])
        if self.k == 0 or n == 0:
            self.step += 1
            out = SparseVector.empty(n, dtype, xp)
            # (a threshold of NaN, which no value meets, infinities included)
            out.info.update(
                threshold=math.nan, counts=[0] * p, selected=0, rederived=False, bucket=None
            )
            out.info.update(layout)
            return out
        mine, counts, used, rederived, cut = self._select(comm, n, part, to_index, found, nonzeros)
        if p == 1:  # the gather and the sum are identities: no copies of the k entries
            idx, sums = mine, values_at(mine)
        else:
            gathered, _ = comm.allgatherv(mine, counts)
            # rank r's chunk is partition (step + r) mod P: put the chunks in partition order
            offs = np.concatenate(([0], np.cumsum(counts)))
            chunks = [gathered[offs[r] : offs[r + 1]] for r in owner if counts[r]]
            idx = xp.concatenate(chunks) if chunks else xp.zeros(0, index_dtype(n))
            sums = values_at(idx) if idx.shape[0] else xp.zeros(0, dtype)
            if idx.shape[0]:  # (the same on every rank) values_at's new array, summed in place
                comm.allreduce(sums, out=sums, op="mean" if mean else "sum", check=False)
        part_counts = [int(counts[r]) for r in owner]
        if self.rebalance and p > 1:
            self.bounds = rebalance(self.bounds, np.asarray(part_counts), self.tolerance)
        self.step += 1
        out = SparseVector(idx, sums, n)
        out.info.update(
            threshold=used,
            counts=part_counts,
            selected=int(mine.shape[0]),
            rederived=rederived,
            bucket=None if cut is None else (cut.lo, cut.hi, cut.start),
            **layout,
        )
        return out

    def _select(
        self,
        comm: Communicator,
        n: int,
        part: Any,
        to_index: Any,
        found: Any = None,
        nonzeros: int | None = None,
    ) -> tuple[Any, list[int], float, bool, _Bucket | None]:
        """The global indices selected in ``part`` (``to_index`` maps positions in it to
        them), every rank's count, the threshold used, whether it was re-derived, and the
        cut through a bucket (None: every |value| >= the threshold was selected).
        ``found``: part's entries at or above :meth:`candidate_cut` (a :class:`_Found`),
        when the caller has them; ``nonzeros``: part's nonzeros, when the caller counted
        them (see :meth:`reduce_dense`)."""
        if self.k >= n and self.rule != "authors":
            return self._every_nonzero(comm, part, to_index, found)
        rederived, cause, every = False, 0, False  # cause: the miss that re-derived (±1)
        before = self.threshold
        if self.threshold is None:
            if found is not None:
                found.restore()
            found = None
            self.threshold, every = self._derive(comm, n, part)
            rederived = True
        self._cooldown = max(0, self._cooldown - 1)
        while True:
            if self.threshold is None:  # every partition is all zeros (known on every rank)
                self.rederives += rederived
                self._keep_centre(before)
                empty = get_array_module(part).zeros(0, dtype=np.int64)
                return to_index(empty), [0] * comm.size, math.inf, rederived, None
            if self.rule == "authors":
                t = _cut(part.dtype, self.threshold)
                found = _above(part, t) if found is None else found
                counts = comm.allgather_ints(-1 if found is None else int(found.idx.shape[0]))
                _agree_no_nan(np.asarray(counts).reshape(-1, 1))
                mine = found.take(t, to_index)
                self.threshold = authors_rule(self.threshold, sum(counts), self.k)
                self.rederives += rederived
                return mine, counts, t, rederived, None
            found, counts, used, side, cut, total = self._window(comm, part, found, nonzeros, every)
            missed = side != 0
            if not missed or rederived:
                break
            # a cooldown holds off re-deriving only for misses like the one that started it
            # (fewer than k nonzeros in all keeps missing low); a miss the other way (the
            # data grew past k) re-derives at once, and so does a miss low once there are
            # k nonzeros again (the data's scale fell below the window)
            held = self._cooldown and side == self._cooldown_side
            if held and (side > 0 or 0 <= total <= self.k + 0.05 * self.k):
                break
            found.restore()
            found = None  # the candidates were for the old threshold
            self.threshold, every = self._derive(comm, n, part)
            rederived, cause = True, side
        mine = found.take(used, to_index) if cut is None else found.take_bucket(cut, to_index)
        self.rederives += rederived
        if side < 0:  # at most k + 5% nonzeros in all: the call kept every one (_window)
            self._keep_centre(before)
            return mine, counts, used, rederived, cut
        if missed and rederived:
            # k is outside the window even right after a re-derive (ties or infinities
            # above it): follow the window instead of re-deriving every call
            self._cooldown = COOLDOWN
            self._cooldown_side = side
        elif rederived and cause <= 0:
            # k inside the window again after a miss low: the partitions hold k nonzeros
            # again (their scale fell below the window), and the cooldown is over. A miss
            # high ends none: the nonzeros are still counted, as partitions that held
            # fewer than k come round again to owners of the same data
            self._cooldown = 0
        self.threshold = used if 0 < used < math.inf else None
        if rederived or not before or self.threshold is None:
            self.growth, self.swing, self.trend_calls = 0.0, SWING0, 0
        else:
            step = min(max(math.log(self.threshold / before), -0.2), 0.2)
            if self.trend_calls:  # (the first change after a reset is no deviation)
                self.swing = 0.5 * self.swing + 0.5 * abs(step - self.growth)
            self.growth = 0.5 * self.growth + 0.5 * step
            self.trend_calls += 1
        return mine, counts, used, rederived, cut

    def _keep_centre(self, before: float | None) -> None:
        """After a call whose partitions held at most k + 5% nonzeros in all (it kept every
        one): count the nonzeros for the next COOLDOWN calls, and centre the next window
        where the last call that could reach k left it (``before``; the re-derived
        smallest nonzero when there was none): the owners rotate over the same data, so
        partitions that held fewer than k may hold more on the next call."""
        self._cooldown, self._cooldown_side = COOLDOWN, -1
        if before is not None:
            self.threshold = before

    def _every_nonzero(
        self, comm: Communicator, part: Any, to_index: Any, found: _Found | None
    ) -> tuple[Any, list[int], float, bool, None]:
        """:meth:`_select` when k >= n: every nonzero of ``part``, as a top-k of fewer than
        k entries keeps all (the window's nearest edge, within 5% of k, left out the
        smallest few: 998 of 1000 at density 1). The threshold state is left as it is."""
        if found is not None:
            found.restore()  # (part whole again: read here, and by the caller's values_at)
        tiny = float(np.finfo(part.dtype).smallest_subnormal)
        every = _above(part, tiny)
        counts = comm.allgather_ints(-1 if every is None else int(every.idx.shape[0]))
        _agree_no_nan(np.asarray(counts).reshape(-1, 1))
        assert every is not None  # (agreed above)
        return every.take(tiny, to_index), counts, tiny, False, None

    def _window(
        self,
        comm: Communicator,
        part: Any,
        found: _Found | None = None,
        counted: int | None = None,
        every: bool = False,
    ) -> tuple[_Found, list[int], float, int, _Bucket | None, int]:
        """The window edge nearest k: the candidates it selects from, every rank's count
        at it, the edge, how k was missed (0 inside the window, +1 too many even at the
        top edge, -1 too few even at the bottom one, or at most k + 5% nonzeros in all,
        counted: then every nonzero, at the smallest subnormal), the cut through a bucket
        when even the nearest edge misses k by more than 5% (see :meth:`_bucket`), and
        the ranks' nonzeros in all (counted only while a cooldown after a miss low holds,
        or with ``every``; else -1). ``found``
        (candidates from window edge ``found.low`` up): when the pick could lie below it,
        every rank counts its whole part and the counts are exchanged again, so the pick
        is the same as from all edges. ``counted``: this rank's nonzeros, when the caller
        counted them. ``every``: a re-derive found fewer than k nonzeros in all; the
        candidates are then every nonzero, and their counts the nonzeros."""
        cast = _edges(self.threshold, part.dtype)  # counts == selections in that dtype
        e, tol = cast.shape[0], 0.05 * self.k
        # while a cooldown after too few nonzeros holds (the same on every rank), the counts
        # carry each rank's nonzeros too: a call with at most k + 5% of them keeps every
        # one, and a miss low with more re-derives
        nonzeros = every or self._counting(self._cooldown)
        tiny = float(np.finfo(part.dtype).smallest_subnormal)
        while True:
            # zeros are never selected, even where a tiny edge rounds to 0 in the data's dtype
            if found is None:
                found = _above(part, tiny if every else _cut(part.dtype, float(cast[0])))
            # the counts, the lowest edge known, then the nonzeros
            row = np.full(e + 1 + nonzeros, -1, dtype=np.int64)
            if found is not None:
                row[:e] = 0
                row[found.low : e] = edge_totals(found.values, cast[found.low :])
                row[e] = found.low
                if every:
                    row[e + 1] = found.idx.shape[0]
                elif nonzeros:
                    row[e + 1] = _count_nonzeros(part, found, counted)
                    row[0] = min(row[0], row[e + 1])  # (-1: a NaN, flagged as _above does)
            table = np.asarray(comm.allgather_ints(row)).reshape(comm.size, -1)
            _agree_no_nan(table)
            known = int(table[:, e].max())
            total = table[:, :e].sum(axis=0)
            total_nonzeros = int(table[:, e + 1].sum()) if nonzeros else -1
            if 0 <= total_nonzeros <= self.k + tol:
                # at most k + 5% nonzeros in all: every one is what a top-k keeps within
                # the 5% (a re-derive's k-th largest of fewer than k is the smallest; of a
                # few more, one of the smallest: a centre far below the next call's k),
                # and this exchange carried their counts: no recount, no re-derive
                if not every:
                    found.restore()
                    found = _above(part, tiny)
                assert found is not None and found.idx.shape[0] == table[comm.rank, e + 1]
                return found, table[:, e + 1].tolist(), tiny, -1, None, total_nonzeros
            if known == 0 or not _below_needed(total[known:], self.k, tol):
                break
            found.restore()
            found = None
            self.recounts += 1
        j, missed = pick_edge(total[known:], self.k, tol)
        j += known
        side = 0 if not missed else (1 if j == e - 1 else -1)
        if not missed and abs(int(total[j]) - self.k) > tol:
            bucket = self._bucket(comm.rank, table[:, :e], known, cast)
            if bucket is not None:
                counts, lo, cut = bucket
                return found, counts, lo, side, cut, total_nonzeros
        if side > 0 and math.isinf(float(cast[j])):
            # more than k infinities: no edge lies above them, and no re-derive can move the
            # window past them. Cut the tie to k in index order, as any other: nothing is
            # >= NaN, so the bucket [inf, NaN) is every infinity
            counts, cut = self._cut_run(comm.rank, table[:, j] * 0, table[:, j], math.nan, math.inf)
            return found, counts, math.inf, 0, cut, total_nonzeros
        return found, table[:, j].tolist(), float(cast[j]), side, None, total_nonzeros

    def _bucket(
        self, rank: int, table: np.ndarray, known: int, cast: np.ndarray
    ) -> tuple[list[int], float, _Bucket] | None:
        """k exactly where no edge of the window comes within 5% of it: many magnitudes
        tie, or lie close together, between two neighbouring edges (quantised gradients,
        or a tie across a whole layer, where the nearest edge could keep nothing). Cut
        as oktopk's window calls do: every |value| >= ``hi`` (the lowest edge with fewer
        than k at or above it) and, from the bucket ``[lo, hi)`` in index order
        (partitions in index order), a run that starts at :func:`bucket_start` and wraps
        around, completing k. Every rank's count, ``lo`` (the threshold reported, and
        the next window's centre) and this rank's cut; None when k is not bracketed."""
        total = table.sum(axis=0)
        b = bracket_edge(total[known:], self.k)
        if b is None or known + b + 1 == total.shape[0]:
            return None
        j = known + b
        above = table[:, j + 1]
        lo, hi = float(cast[j]), float(cast[j + 1])
        counts, cut = self._cut_run(rank, above, table[:, j] - above, hi, lo)
        return counts, lo, cut

    def _cut_run(
        self, rank: int, above: np.ndarray, bucket: np.ndarray, hi: float, lo: float
    ) -> tuple[list[int], _Bucket]:
        """Every rank's count and this rank's cut when each rank r keeps its ``above[r]``
        entries >= ``hi`` and its share of a run through the ``bucket`` (its entries in
        ``[lo, hi)``, partitions in index order) that completes k."""
        start = bucket_start(self.step, int(bucket.sum()))
        # the bucket laid out partition after partition (their owners' counts in index order)
        shares = bucket_shares(bucket[self._owners()], self.k - int(above.sum()), start)
        mine = [shares[self._partition(r)] for r in range(bucket.shape[0])]
        counts = [int(above[r]) + sum(b - a for a, b in share) for r, share in enumerate(mine)]
        return counts, _Bucket(lo, hi, mine[rank], counts[rank], start)

    def _derive(self, comm: Communicator, n: int, part: Any) -> tuple[float | None, bool]:
        """The global k-th largest nonzero |value| (:func:`derive_threshold`; every rank
        first sends its top ``min(k, ceil(2k·span/n) + 1)``, span: its partition's length),
        and whether fewer than k came."""
        takes = []
        for r in range(comm.size):
            lo, hi = self.owned_range(r)  # the span, not m: sparse and dense input agree
            takes.append(min(self.k, -(-2 * self.k * (hi - lo) // max(n, 1)) + 1))
        return derive_threshold(comm, self.k, takes, part)

    # -- checks -----------------------------------------------------------------------------
    def verify(
        self, result: SparseVector, reference: SparseVector, inputs: list[SparseVector]
    ) -> bool:
        """Sorted unique indices, at each the exact sum of every rank's input, and in each
        partition of the call (``info["ranges"]``, selected by ``info["owners"]``) the
        owner's selection: ``info["counts"]`` entries, every index where its input has
        |value| >= the threshold and no other (with a cut through a bucket
        ``(lo, hi, start)``: every |value| >= hi, none below lo, exactly k in all)."""
        ri = np.asarray(to_host(result.indices)).astype(np.int64)
        if ri.shape[0] > 1 and np.any(np.diff(ri) <= 0):
            return False
        refi = np.asarray(to_host(reference.indices))
        refv = np.asarray(to_host(reference.values))
        pos = np.minimum(np.searchsorted(refi, ri), max(refi.shape[0] - 1, 0))
        hit = refi[pos] == ri if refi.shape[0] else np.zeros(ri.shape[0], bool)
        want = np.where(hit, refv[pos] if refi.shape[0] else 0, 0).astype(reference.dtype)
        if not allclose_sparse(result, SparseVector(ri, want, result.n), inputs):
            return False
        info = result.info
        bucket = info.get("bucket")
        low, high = (bucket[0], bucket[1]) if bucket else (info["threshold"],) * 2
        if bucket and ri.shape[0] != self.k:
            return False
        seen = 0
        for owner, (lo, hi), count in zip(info["owners"], info["ranges"], info["counts"]):
            x = inputs[owner]
            xi = np.asarray(to_host(x.indices)).astype(np.int64)
            mag = np.abs(np.asarray(to_host(x.values), np.float64))
            inside = (xi >= lo) & (xi < hi)
            got = ri[(ri >= lo) & (ri < hi)]
            must = xi[inside & (mag >= high)]
            may = xi[inside & (mag >= low) & (mag > 0)]
            if got.shape[0] != count or not np.all(np.isin(must, got)):
                return False
            if not np.all(np.isin(got, may)):
                return False
            seen += got.shape[0]
        return seen == ri.shape[0]

    def __repr__(self) -> str:
        return f"<sparsecoll algorithm 'exdyna' k={self.k} rule={self.rule!r}>"
