"""SparseHookState: the DDP hook's state, one GradientReducer per bucket (built after the
dense warm-up, rebuilt when a bucket's layout or the density changes), its statistics and
checkpoint. Every rank builds the same state; its reducers agree on the hook's options."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ..._agree import agreement, collective_check, watch
from ..._options import check_density, integer, read_only
from ...comm import CommStats, Communicator
from ...training import GradientReducer
from ._group import group_comm, group_mismatch, world_mismatch

__all__ = ["HOOK_AGREED", "WARMUP_MARK", "SparseHookState", "add_traffic"]

# what the warm-up's agreement and each bucket reducer's step agreement hold first, named
# alike on every rank: a rank still in its dense warm-up (a longer ``warmup``) while another
# steps differs from it in the third (the warm-up's -1, a step's CRC of its options: >= 0)
HOOK_AGREED = (
    "bucket size",
    "bucket dtype",
    "warmup (a rank in its dense warm-up while another steps), algorithm or options",
    "step",
)
WARMUP_MARK = -1
# why a state's algorithm and options cannot be set (each bucket's reducer was built with them)
_FIXED = (
    "a SparseHookState's {what} is fixed at construction (the buckets' reducers are built "
    "with it: setting it left them as they were), got {value!r}: build a new "
    "SparseHookState on every rank (density, warmup and nonfinite may be set between "
    "iterations)"
)
# what a bucket reducer's state holds for its density (its k): taken from a fresh reducer
# when the state was saved at another density
DENSITY_STATE = (
    "density", "algorithm_state", "algorithm_version", "selection_state", "selection_version",
    "topk_state",
)  # fmt: skip


class SparseHookState:
    """State of :func:`sparse_allreduce_hook` (or :func:`async_sparse_allreduce_hook`): one
    GradientReducer per DDP bucket.

    Args:
        comm: an mpi4py Intracomm or a sparsecoll Communicator (default: COMM_WORLD, or
            with ``process_group`` one built of the group's processes).
        process_group: DDP's process group (``ddp.process_group``; ``dist.group.WORLD``
            for the default one), as torch's own hook states take it: the hook cannot see
            it (it gets the bucket only). Given, building the state is collective over the
            communicator, and raises a CollectiveInputError on every rank, naming the
            rank, unless the communicator holds exactly the group's processes in its
            order. Without ``comm``, the state builds its communicator of the group's
            processes (collective over the group: its processes gather their MPI ranks
            over it, then MPI_Comm_create_group).
        algorithm, density: as for :class:`~sparsecoll.GradientReducer` (default
            ``"oktopk"``, as the reducer's).
        warmup: iterations reduced densely first (>= 1: DDP's buckets change after the first;
            with ``static_graph=True`` after the second: use 2), the same on every rank (a
            rank still in its warm-up while another steps raises a CollectiveInputError on
            every rank saying so). A bucket whose layout changes later gets a fresh reducer,
            with a RuntimeWarning; its residual is dropped.
        nonfinite: what a bucket whose gradient holds NaN or Inf (on any rank) comes back as:
            ``"raise"`` (default): ``backward()`` raises on every rank (a RuntimeError naming
            the :class:`~sparsecoll.NonFiniteError`); ``"nan"``: the bucket is filled with
            NaN on every rank and backward goes on, so that loss scaling
            (``torch.amp.GradScaler``) skips the step and lowers its scale, as with DDP's
            own hook. Either way that bucket's reducer keeps its residual, and the buckets
            that stepped in that iteration take theirs back after its last bucket (the
            batch is skipped: nothing they sent is lost; do not apply their updates).
            The same on every rank (each bucket's step agrees on it).
        **options: more GradientReducer options (``error_feedback``, algorithm options).

    Every rank must build the same state, one per DDP model (one model re-wrapped in a new
    DDP may keep it). ``stats()`` sums the byte counts over buckets;
    ``state_dict()``/``load_state_dict()`` save and restore every bucket's reducer (with the
    asynchronous hook: after the iteration's backward, when no bucket is in flight);
    ``reset()`` drops their state.
    """

    __slots__ = (
        "_algorithm",
        "_comm",
        "_density",
        "_failed",
        "_failures",
        "_launch_checked",
        "_layouts",
        "_nonfinite",
        "_options",
        "_outside_stats",
        "_pending",
        "_pending_layouts",
        "_pending_until",
        "_process_group",
        "_stepped",
        "_warmup",
        "iteration",
        "reducers",
    )

    def __init__(
        self,
        comm: Any = None,
        algorithm: str = "oktopk",
        density: float = 0.01,
        *,
        process_group: Any = None,
        warmup: int = 1,
        nonfinite: str = "raise",
        **options: Any,
    ) -> None:
        _check_warmup(warmup)
        if "average" in options or "warmup" in options:
            raise TypeError("the hook always averages and handles the warm-up itself")
        if "k" in options:  # (a bucket reducer's k is round(density·its n))
            raise TypeError(
                f"the hook takes density, not k: DDP's buckets differ in size, and each "
                f"bucket reducer sends round(density·n) entries of its n; pass "
                f"density=k/parameters (e.g. density={options['k']}/sum(p.numel() for p in "
                f"model.parameters())) instead of k={options['k']!r}"
            )
        self._process_group = process_group
        if process_group is not None and comm is None:
            comm = group_comm(process_group)
        self._comm = Communicator.wrap(comm)
        if process_group is None:
            self._setup(algorithm, density, warmup, nonfinite, options)
            return
        # with a process_group, building the state is collective over the communicator: an
        # error in the arguments on one rank is raised on every rank with the group's check
        error = None
        try:
            self._setup(algorithm, density, warmup, nonfinite, options)
        except Exception as exc:  # (shared with every rank: none is left waiting)
            error = exc
        group_error, sig, detail = group_mismatch(self._comm, process_group)
        label = "SparseHookState()"
        with self._comm.serial(), watch(self._comm, label):
            collective_check(
                self._comm, error or group_error, sig, ("process_group",), detail, call=label
            )

    def _setup(
        self,
        algorithm: str,
        density: float,
        warmup: int,
        nonfinite: str,
        options: dict[str, Any],
    ) -> None:
        # refused here, or at the first bucket when torch.distributed starts later
        self._launch_checked = False
        self._check_launch()
        self._algorithm = algorithm
        self.density = density
        self.warmup = warmup
        self.nonfinite = nonfinite
        self._options = dict(options)
        self.iteration = 0
        self.reducers: dict[int, GradientReducer] = {}
        self._layouts: dict[int, tuple[Any, ...]] = {}
        self._pending: dict[int, dict[str, Any]] = {}
        self._pending_layouts: dict[int, tuple[Any, ...]] = {}
        self._pending_until = 0
        # traffic that no current reducer counts: dense warm-ups, and reducers replaced
        # when their bucket changed
        self._outside_stats = CommStats()
        # (iteration, reducer) for each bucket that stepped, and the iterations in which a
        # bucket's reduction failed: an iteration that never reached its last bucket
        # leaves entries that a later iteration's end ignores
        self._stepped: list[tuple[int, GradientReducer]] = []
        self._failed: set[int] = set()
        self._failures: list[tuple[Any, BaseException]] = []  # async: errors held back
        # fail early, on every rank alike, on a bad algorithm name or option
        GradientReducer(self.comm, 1, algorithm, self.density, **options)

    def _check_launch(self) -> None:
        """Raise RuntimeError when torch's world is not the hook's (see _world_mismatch);
        once torch.distributed is initialized, checked once."""
        if self._launch_checked:
            return
        why = world_mismatch(self.comm)
        if why is not None:
            raise RuntimeError(why)
        dist = sys.modules.get("torch.distributed")
        self._launch_checked = dist is not None and dist.is_initialized()

    algorithm = read_only(
        "_algorithm",
        "algorithm",
        """The algorithm's name, fixed at construction (each bucket's reducer holds its
        state): for another, build a new state (a checkpoint of this one is refused there).""",
    )
    comm = read_only(
        "_comm",
        "comm",
        """The communicator every bucket is reduced over, fixed at construction as the
        algorithm is (the buckets' reducers are built on it).""",
    )
    process_group = read_only(
        "_process_group",
        "process_group",
        """DDP's process group that the communicator was checked against (None: not given,
        nothing checked), fixed at construction as the communicator is.""",
    )

    @property
    def options(self) -> Mapping[str, Any]:
        """The reducers' other options (read-only), fixed at construction as the algorithm
        is (the buckets' reducers are built with them)."""
        return MappingProxyType(self._options)

    @options.setter
    def options(self, value: Any) -> None:
        self._refuse("options", value)

    def _refuse(self, name: str, value: Any) -> None:
        raise AttributeError(_FIXED.format(what=name, value=value))

    @property
    def nonfinite(self) -> str:
        """What a bucket whose gradient holds NaN or Inf comes back as: ``"raise"`` or
        ``"nan"``. The same on every rank (each bucket's step agrees on it); it may be set
        between iterations, on every rank alike."""
        return self._nonfinite

    @nonfinite.setter
    def nonfinite(self, value: str) -> None:
        if value not in ("raise", "nan"):
            raise ValueError(f"nonfinite must be 'raise' or 'nan', got {value!r}")
        self._nonfinite = value
        for red in getattr(self, "reducers", {}).values():
            self._agree_on_hook_options(red)

    def _agree_on_hook_options(self, red: GradientReducer) -> None:
        """Make ``red``'s steps agree on this state's ``nonfinite`` too."""
        red.agree_on("nonfinite", self._nonfinite)

    @property
    def warmup(self) -> int:
        """Iterations reduced densely first, counted from the state's first (``iteration``):
        at least 1. It may be set between iterations, alike on every rank (a rank still in
        its warm-up while another steps raises on every rank); checked as the constructor
        checks it."""
        return self._warmup

    @warmup.setter
    def warmup(self, value: int) -> None:
        self._warmup = _check_warmup(value)

    @property
    def density(self) -> float:
        """The requested density. Set it (on every rank alike, between iterations) to change
        it during training, e.g. a sparsity warm-up: each bucket's reducer is rebuilt at the
        new density when the bucket next comes by, its residual, velocity, step count and
        byte counts carried over (its algorithm's and selection's state start afresh: they
        are k's)."""
        return self._density

    @density.setter
    def density(self, value: float) -> None:
        self._density = check_density(value)

    def _new_reducer(self, numel: int, saved: dict[str, Any] | None = None) -> GradientReducer:
        """A bucket reducer at the current density, with ``saved``'s state (a reducer's
        state_dict); saved at another density, all but its algorithm's and selection's."""
        red = GradientReducer(self.comm, numel, self.algorithm, self.density, **self._options)
        red.signature_names = HOOK_AGREED
        self._agree_on_hook_options(red)
        if saved is not None:
            if saved.get("density", self.density) != self.density:
                fresh = red.state_dict()
                saved = {**saved, **{key: fresh[key] for key in DENSITY_STATE}}
            red.load_state_local(saved)  # (agreed by load_state_dict, collective)
        return red

    def reducer(
        self, index: int, numel: int, dtype: str, params: Any = ()
    ) -> GradientReducer | None:
        """The reducer of bucket ``index`` (built on first use, rebuilt if its layout changed:
        its size, or which parameters it holds in which order); None while the bucket waits
        for the layout of a restored state (the hook then reduces it densely)."""
        shapes = tuple(tuple(p.shape) for p in params)
        layout = (numel, dtype, shapes, tuple(id(p) for p in params))
        red = self.reducers.get(index)
        replaced = None
        if red is not None and self._layouts[index] != layout:
            old = self._layouts[index]
            what = f"{old[0]} to {numel} elements" if old[0] != numel else "its parameters"
            warnings.warn(
                f"DDP bucket {index} changed ({what}, {dtype}) after the warm-up; its "
                f"residual is dropped (expected once after a model's parameters change; "
                f"at every iteration, the state serves two DDP models, which is not "
                f"supported: build one SparseHookState per model)",
                RuntimeWarning,
                stacklevel=3,
            )
            replaced, red = red, None
        # (what is kept changes only once the new reducer is built: building it can fail
        # on this rank alone, e.g. out of memory for a copy of n values, and then the
        # bucket's next iteration tries again from where every other rank started)
        if red is not None and red.density != self.density:  # (a new density was set)
            red = self.reducers[index] = self._new_reducer(numel, red.state_dict())
        if red is None:
            saved = self._pending.get(index)
            if saved is not None:
                want = self._pending_layouts.get(index, (saved["n"], dtype, shapes))
                if saved["n"] != numel or want != (numel, dtype, shapes):
                    if self.iteration < self._pending_until:
                        return None  # (a fresh DDP's first buckets are not its last ones)
                    warnings.warn(
                        f"DDP bucket {index} does not match its restored state; the saved "
                        f"residual is dropped",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                    saved = None
            red = self._new_reducer(numel, saved)
            self._pending.pop(index, None)
            if replaced is not None:  # (its traffic stays counted)
                add_traffic(self._outside_stats, replaced.traffic)
            self.reducers[index] = red
            self._layouts[index] = layout
        return red

    def stats(self) -> dict[str, Any]:
        """Iterations, bytes per rank (warm-up included) and densities over every bucket."""
        reds = list(self.reducers.values())
        each = [r.stats() for r in reds]  # (one call a reducer: each builds a dict)
        outside = self._outside_stats
        sent = outside.bytes_sent + sum(s["bytes_sent_total"] for s in each)
        recv = outside.bytes_recv + sum(s["bytes_recv_total"] for s in each)
        n = sum(r.n for r in reds)
        last = sum(s["achieved_density"] * r.n for s, r in zip(each, reds))
        return {
            "iterations": self.iteration,
            "buckets": len(reds),
            "parameters": n,
            "requested_density": self.density,
            "achieved_density": last / n if n else 0.0,
            "bytes_sent_total": sent,
            "bytes_recv_total": recv,
            "bytes_sent_last": sum(s["bytes_sent"] for s in each),
            "dense_bytes_per_iteration": sum(s["dense_bytes"] for s in each),
        }

    def state_dict(self) -> dict[str, Any]:
        # restored states no bucket has taken yet are saved again as they came
        return {
            "iteration": self.iteration,
            "reducers": {
                **self._pending,
                **{i: r.state_dict() for i, r in self.reducers.items()},
            },
            # what each bucket held (size, dtype, parameter shapes in order): a restored
            # residual goes only to a bucket laid out alike
            "layouts": {
                **{i: v for i, v in self._pending_layouts.items() if i in self._pending},
                **{i: self._layouts[i][:3] for i in self.reducers},
            },
        }

    def reset(self) -> None:
        """Drop every bucket's residual, velocity and algorithm state (each reducer's
        :meth:`~sparsecoll.GradientReducer.reset`) and the byte counters, keeping the
        buckets and the iteration count (no new dense warm-up). Call it on every rank."""
        for red in self.reducers.values():
            red.reset()
        self._pending.clear()
        self._stepped, self._failed, self._failures = [], set(), []
        self._outside_stats = CommStats()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; each bucket's reducer is rebuilt when the bucket next comes by laid out
        as when saved. Into a fresh DDP (a restarted job) that is after DDP's bucket rebuild
        (after its first iteration; its second with ``static_graph=True``): until then a
        bucket whose saved state does not match is reduced densely, nothing lost; a saved
        state no bucket matches within 3 iterations is dropped with a RuntimeWarning.

        Collective: call it on every rank. A state saved at another density is taken (each
        bucket's residual carried over to this state's density), and so is one saved with
        another ``warmup`` or ``nonfinite`` (the saved iteration decides whether the warm-up
        is over). One that a bucket's reducer would refuse (another algorithm, number of
        ranks, rank, selection, momentum, ``error_feedback`` or options: each rank loads
        the state it saved), or whose iteration differs between the ranks, raises the same
        error on every rank (a CollectiveInputError naming the rank), and this state is
        left as it was."""
        label = "SparseHookState.load_state_dict()"  # (watched, as the buckets' steps are)
        names = ("iteration", "saved buckets")
        with (
            self.comm.serial(),
            watch(self.comm, label),
            agreement(self.comm, names, call=label) as agree,
        ):
            # (as saved: an int >= 0, not converted)
            iteration = integer("the saved iteration", state["iteration"], 0)
            layouts = state.get("layouts", {})
            for key in ("reducers", "layouts"):  # (read after the ranks agree: checked here)
                if not isinstance(state.get(key, {}), dict):
                    raise TypeError(
                        f"the saved {key} must be a dict, got {type(state[key]).__name__}"
                    )
            for index, saved in state["reducers"].items():
                # (a bucket index: no other key, e.g. "0", matches a bucket)
                integer("a saved bucket index", index, 0)
                try:  # (as the bucket's reducer will take it)
                    self._new_reducer(integer("n", saved["n"], 0), saved)
                except Exception as exc:
                    raise ValueError(f"the saved state of bucket {index}: {exc}") from exc
            for index, layout in layouts.items():
                _check_layout(index, layout, state["reducers"])
            agree.signature = [iteration, len(state["reducers"])]
        self.iteration = iteration
        self.reducers.clear()
        self._layouts.clear()
        self._stepped, self._failed = [], set()
        self._pending = dict(state["reducers"])
        self._pending_layouts = dict(layouts)
        self._pending_until = self.iteration + 3


def _check_warmup(value: Any) -> int:
    """A hook state's warmup: an integer >= 1 (a TypeError for another type, a ValueError
    below 1)."""
    try:
        return integer("warmup", value, 1)
    except (TypeError, ValueError) as exc:
        raise type(exc)(
            f"{exc} (DDP rebuilds its buckets after the first iteration, so the first one "
            f"is reduced densely)"
        ) from None


def _check_layout(index: Any, layout: Any, reducers: dict[Any, Any]) -> None:
    """A saved bucket layout as state_dict() writes it: for a saved bucket, its size (the
    bucket's n), dtype name and parameter shapes (no other layout matches a bucket)."""
    saved = reducers.get(index)
    if saved is None:
        raise ValueError(f"the saved layouts hold bucket {index!r}, whose state is not saved")
    ok = isinstance(layout, tuple) and len(layout) == 3 and isinstance(layout[1], str)
    if not ok or layout[0] != saved["n"] or not isinstance(layout[2], tuple):
        raise ValueError(
            f"the saved layout of bucket {index} must be (n={saved['n']}, a dtype name, "
            f"the parameters' shapes), got {layout!r}"
        )


def add_traffic(totals: CommStats, delta: CommStats) -> None:
    """Add ``delta``'s bytes and messages sent and bytes received to ``totals``."""
    for f in ("bytes_sent", "bytes_recv", "messages_sent", "meta_bytes_sent"):
        setattr(totals, f, getattr(totals, f) + getattr(delta, f))
