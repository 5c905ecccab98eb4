"""PyTorch DistributedDataParallel: a communication hook that reduces each gradient bucket with
a :class:`sparsecoll.training.GradientReducer` over MPI, and a gloo process group from MPI.

Three lines in a training script (after the model is built)::

    from sparsecoll.integrations import torch as sc_torch
    sc_torch.init_process_group()                       # gloo, rank/size from MPI
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(sc_torch.SparseHookState(density=0.01, algorithm="exdyna"),
                           sc_torch.sparse_allreduce_hook)

:func:`async_sparse_allreduce_hook` (same state) overlaps: it queues each bucket on the
communicator's progress thread and returns a pending future, so early buckets are reduced
while backward computes the rest (see docs/api.md, "Nonblocking calls").

DDP needs a torch process group even when the hook does all the gradient traffic (it
broadcasts the initial parameters and checks their shapes through it): gloo is enough.
DDP rebuilds its buckets after the first iteration (in the order gradients became ready), so
the hook reduces densely for ``warmup`` iterations (at least one) before it gives each bucket
its own reducer (with its own residual); a bucket whose layout (size, or which parameters
in which order) changes later gets a fresh reducer, with a warning, and the old residual is
dropped (``static_graph=True``: DDP rebuilds after the second iteration, use ``warmup=2``).
Torch is imported only when these functions are used.
"""

from __future__ import annotations

import os
import socket
import sys
import warnings
import zlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from .._agree import collective_check, watch
from .._array import as_array, device_scope, is_device_array, synchronize
from .._launch import torch_launcher_mismatch
from .._mpilib import mpi as _mpi
from .._options import check_density, integer, read_only
from ..comm import CommStats, Communicator, widening_buffer
from ..errors import NonFiniteError
from ..sparse import VALUE_DTYPES
from ..training import GradientReducer, _add_totals

__all__ = [
    "SparseHookState",
    "async_sparse_allreduce_hook",
    "init_process_group",
    "sparse_allreduce_hook",
]


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


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise RuntimeError("PyTorch is not available: pip install 'sparsecoll[torch]'") from exc
    return torch


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_process_group(
    comm: Any = None,
    backend: str = "gloo",
    *,
    addr: str | None = None,
    port: int | None = None,
    **kwargs: Any,
) -> None:
    """Initialize ``torch.distributed`` with the rank and size of the MPI communicator.

    Rank 0 picks the rendezvous address and port and broadcasts them over MPI. The address
    is, in order: ``addr``, the environment's ``MASTER_ADDR``, 127.0.0.1 when every rank
    runs on the same host, else rank 0's host name resolved; the port: ``port``, the
    environment's ``MASTER_PORT``, else a free TCP port. ``kwargs`` go to
    ``torch.distributed.init_process_group`` (e.g. ``timeout``).

    Launch with mpiexec. Under torchrun each process is an MPI world of one: when
    ``WORLD_SIZE``, ``RANK``, ``LOCAL_WORLD_SIZE`` or ``LOCAL_RANK`` (set by torchrun)
    disagree with MPI's COMM_WORLD on any rank, every rank raises RuntimeError, naming the
    rank (before, torch's rendezvous waited until its timeout).
    """
    _torch()
    import torch.distributed as dist

    c = Communicator.wrap(comm)
    if dist.is_initialized():
        raise RuntimeError("a torch process group is already initialized")
    world = _mpi_world()
    mismatch = torch_launcher_mismatch(world.Get_size(), world.Get_rank())
    # the MPI exchanges watched as a blocking call (SPARSECOLL_TIMEOUT): a rank that
    # skipped the call left the others in them for ever (torch's own timeout covers its
    # rendezvous only)
    with c.serial(), watch(c, "init_process_group()"):
        seen = c.allgather_object((socket.gethostname(), mismatch))
        for r, (_, why) in enumerate(seen):
            if why is not None:
                raise RuntimeError(f"{why} (rank {r})")
        hosts = [h for h, _ in seen]
        info: Any = None
        if c.rank == 0:
            try:
                info = _rendezvous(hosts, addr, port)
            except ValueError as exc:  # (shared with every rank: none is left waiting)
                info = str(exc)
        info = c.bcast_object(info, 0)
    if isinstance(info, str):
        raise ValueError(f"{info} (rank 0)")
    host, port = info
    dist.init_process_group(
        backend, init_method=f"tcp://{host}:{port}", rank=c.rank, world_size=c.size, **kwargs
    )


def _mpi_world() -> Any:
    return _mpi().COMM_WORLD


def _rendezvous(hosts: list[str], addr: str | None, port: int | None) -> tuple[str, int]:
    """Rank 0's choice of the rendezvous address and port (see init_process_group)."""
    host = addr or os.environ.get("MASTER_ADDR")
    if host is None:
        same = all(h == hosts[0] for h in hosts)
        host = "127.0.0.1" if same else socket.gethostbyname(hosts[0])
    if port is None and os.environ.get("MASTER_PORT"):
        value = os.environ["MASTER_PORT"].strip()
        if not value.isdigit() or not 0 < int(value) < 65536:
            raise ValueError(f"MASTER_PORT must be a TCP port (1 to 65535), got {value!r}")
        port = int(value)
    return host, port or _free_port("127.0.0.1" if host == "127.0.0.1" else "")


def _world_mismatch(comm: Communicator) -> str | None:
    """Why the hook cannot reduce over ``comm`` for torch.distributed's world (None when it
    can, or when torch.distributed is not initialized): ``comm`` is the whole MPI world
    but of another size than torch's, as under torchrun (each process an MPI world of one:
    every rank would average its gradients with itself alone). A sub-communicator is left
    alone (it may match a DDP process_group's subgroup). Every rank decides alike: torch's
    world size, ``comm``'s size and whether it spans COMM_WORLD are the same on each."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    size = dist.get_world_size()
    if size == comm.size:
        return None
    from mpi4py import MPI

    if MPI.Comm.Compare(comm.mpi_comm, MPI.COMM_WORLD) not in (MPI.IDENT, MPI.CONGRUENT):
        return None
    return (
        f"torch.distributed has {size} ranks but the hook's communicator, MPI's whole world, "
        f"has {comm.size}: the processes were not started as one MPI job (under torchrun "
        f"each is an MPI world of one, and the hook would average each rank's gradients "
        f"with itself alone); launch with `mpiexec -n {size} python script.py` and "
        f"sc_torch.init_process_group(), not torchrun"
    )


def _group_ranks(process_group: Any) -> list[int]:
    """``process_group``'s members as torch's global ranks, in its order. Raises
    RuntimeError when torch.distributed is not initialized, TypeError for what is no
    process group, ValueError when this process is not in it."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("process_group given, but torch.distributed is not initialized")
    try:
        # (a group's rank -1: not a member, for which torch's list of the group's ranks is
        # another group's)
        member = dist.get_rank(process_group) >= 0
        ranks = [int(r) for r in dist.get_process_group_ranks(process_group)] if member else []
    except Exception:
        what = type(process_group).__name__
        raise TypeError(
            f"process_group must be a torch.distributed process group, got a {what}"
        ) from None
    if not member:
        raise ValueError(
            f"process_group: this process (torch's global rank {dist.get_rank()}) is not in "
            f"it: build a state only where DDP runs on that group"
        )
    return ranks


def _group_comm(process_group: Any) -> Any:
    """An MPI communicator of ``process_group``'s processes in its order, built on the
    group's processes alone: they gather their MPI world ranks over the group (torch) and
    build it from MPI's world (MPI_Comm_create_group: collective over those processes
    only). Raises the same error on every process of the group when they are not one MPI
    job (under torchrun each is rank 0 of an MPI world of one)."""
    _torch()
    import torch.distributed as dist

    members = _group_ranks(process_group)  # (no collective on a group that is not ours)
    world = _mpi_world()
    ranks: list[Any] = [None] * len(members)
    dist.all_gather_object(ranks, world.Get_rank(), group=process_group)
    if len(set(ranks)) != len(ranks):  # (the same list on every process of the group)
        raise RuntimeError(
            f"the process_group's processes are not one MPI job (their ranks in MPI's "
            f"world: {ranks}, as under torchrun, where each is an MPI world of one): launch "
            f"with `mpiexec -n N python script.py` and sc_torch.init_process_group()"
        )
    whole = world.Get_group()
    part = whole.Incl(ranks)
    try:
        return world.Create_group(part)
    finally:
        part.Free()
        whole.Free()


def _group_mismatch(
    comm: Communicator, process_group: Any
) -> tuple[BaseException | None, list[int] | None, Any]:
    """Whether ``comm`` holds exactly ``process_group``'s processes in its order: this
    rank's error (None when its own part agrees), the signature the ranks must agree on
    (the group's global ranks, as a CRC) and that value named for a mismatch's message.
    Every rank agreeing that its communicator rank is the group's global rank at that
    position, in groups alike of the communicator's size, makes the two the same."""
    try:
        ranks = _group_ranks(process_group)
    except Exception as exc:  # (shared with every rank by the caller's agreement)
        return exc, None, None
    me = sys.modules["torch.distributed"].get_rank()
    detail = (((0,), {"process_group (torch's global ranks)": ranks}),)
    sig = [zlib.crc32(repr(ranks).encode())]
    remedy = (
        "DDP's gradients would be averaged over other processes than its group's; pass "
        "process_group alone (the state builds its communicator from the group), or a "
        "communicator of exactly the group's processes in its order"
    )
    error: BaseException | None = None
    if len(ranks) != comm.size:
        error = ValueError(
            f"the hook's communicator has {comm.size} ranks but the process_group has "
            f"{len(ranks)} (torch's global ranks {ranks}): {remedy}"
        )
    elif ranks[comm.rank] != me:
        error = ValueError(
            f"this process is rank {comm.rank} of the hook's communicator but rank "
            f"{ranks.index(me)} of the process_group (torch's global rank {me}; the group: "
            f"{ranks}): {remedy}"
        )
    return error, sig, detail


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
        algorithm, density: as for :class:`~sparsecoll.training.GradientReducer`.
        warmup: iterations reduced densely first (>= 1: DDP's buckets change after the first),
            the same on every rank (a rank still in its warm-up while another steps raises
            a CollectiveInputError on every rank saying so).
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
        algorithm: str = "allgather",
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
            comm = _group_comm(process_group)
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
        group_error, sig, detail = _group_mismatch(self._comm, process_group)
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
        why = _world_mismatch(self.comm)
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
        algorithm is (setting it left the buckets' reducers on the old one while rebuilt
        buckets and the warm-up took the new one: a model reduced over two communicators,
        the ranks' updates differing).""",
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
        is (setting ``state.algorithm`` or ``state.options`` left the reducers already built
        as they were: only the watchdog's name and later buckets took it)."""
        return MappingProxyType(self._options)

    @options.setter
    def options(self, value: Any) -> None:
        self._refuse("options", value)

    def _refuse(self, name: str, value: Any) -> None:
        raise AttributeError(_FIXED.format(what=name, value=value))

    @property
    def nonfinite(self) -> str:
        """What a bucket whose gradient holds NaN or Inf comes back as: ``"raise"`` or
        ``"nan"``. The same on every rank (each bucket's step agrees on it: a rank filling
        NaN while another raised went on silently); it may be set between iterations, on
        every rank alike."""
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
        red._agree_on({**red._agreed_options, "nonfinite": self._nonfinite})

    @property
    def warmup(self) -> int:
        """Iterations reduced densely first, counted from the state's first (``iteration``):
        at least 1. It may be set between iterations, alike on every rank (a rank still in
        its warm-up while another steps raises on every rank); checked as the constructor
        checks it (before, ``state.warmup = "2"`` made every later bucket raise a
        comparison's TypeError, and 0 or 2.5 were taken)."""
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
        red._agreed = HOOK_AGREED
        self._agree_on_hook_options(red)
        if saved is not None:
            if saved.get("density", self.density) != self.density:
                fresh = red.state_dict()
                saved = {**saved, **{key: fresh[key] for key in DENSITY_STATE}}
            red._load(red._read_state(saved))  # (agreed by load_state_dict, collective)
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
                _add_totals(self._outside_stats, replaced._totals)
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
        error, sig = None, None
        try:
            # (as saved: an int >= 0; int() took 2.7 as 2 and "3" as 3)
            iteration = integer("the saved iteration", state["iteration"], 0)
            layouts = state.get("layouts", {})
            for key in ("reducers", "layouts"):  # (read after the ranks agree: checked here)
                if not isinstance(state.get(key, {}), dict):
                    raise TypeError(
                        f"the saved {key} must be a dict, got {type(state[key]).__name__}"
                    )
            for index, saved in state["reducers"].items():
                # (a bucket index: another key, e.g. "0", never matched a bucket)
                integer("a saved bucket index", index, 0)
                try:  # (as the bucket's reducer will take it)
                    self._new_reducer(integer("n", saved["n"], 0), saved)
                except Exception as exc:
                    raise ValueError(f"the saved state of bucket {index}: {exc}") from exc
            for index, layout in layouts.items():
                _check_layout(index, layout, state["reducers"])
            sig = [iteration, len(state["reducers"])]
        except Exception as exc:  # (shared with every rank: none is left waiting)
            error = exc
        label = "SparseHookState.load_state_dict()"  # (watched, as the buckets' steps are)
        with self.comm.serial(), watch(self.comm, label):
            collective_check(self.comm, error, sig, ("iteration", "saved buckets"), call=label)
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
    bucket's n), dtype name and parameter shapes (another never matched a bucket: the
    bucket's state was dropped after 3 iterations, with a warning only)."""
    saved = reducers.get(index)
    if saved is None:
        raise ValueError(f"the saved layouts hold bucket {index!r}, whose state is not saved")
    ok = isinstance(layout, tuple) and len(layout) == 3 and isinstance(layout[1], str)
    if not ok or layout[0] != saved["n"] or not isinstance(layout[2], tuple):
        raise ValueError(
            f"the saved layout of bucket {index} must be (n={saved['n']}, a dtype name, "
            f"the parameters' shapes), got {layout!r}"
        )


def _reduce_bucket(
    state: SparseHookState,
    buf: Any,
    red: GradientReducer | None,
    iteration: int,
    last: bool,
    label: str,
    error: BaseException | None = None,
) -> Any:
    """The bucket's average, for DDP: dense during the warm-up (``red`` None), else ``red``'s
    sparse update; written over ``buf`` and ``buf`` returned, or a new sparse tensor for a
    sparse gradient's bucket. ``last``: the iteration's last bucket, after which an
    iteration in which a bucket failed is taken back. ``label``: the watchdog's name for it.
    ``error``: this rank's failure to get the bucket's reducer, raised on every rank."""
    try:
        return _reduce_one(state, buf, red, iteration, label, error)
    finally:
        if last:
            _end_iteration(state, iteration)


def _end_iteration(state: SparseHookState, iteration: int) -> None:
    """After the iteration's last bucket: if a bucket failed (on every rank alike), the
    training loop skips the batch (backward raised, or GradScaler saw the NaN), so the
    buckets that stepped take their residual back and nothing they sent is lost."""
    # (once each: a backward cut short before its last bucket leaves the iteration count
    # where it was, so a bucket of it may have stepped twice under that number)
    stepped = {id(red): red for it, red in state._stepped if it == iteration}.values()
    failed = iteration in state._failed
    state._stepped, state._failed = [], set()
    if failed:
        for red in stepped:
            red.take_back()


def _reduce_one(
    state: SparseHookState,
    buf: Any,
    red: GradientReducer | None,
    iteration: int,
    label: str,
    error: BaseException | None,
) -> Any:
    # numpy has no bfloat16: such a bucket is reduced in float32 (exact widening), its
    # residual kept in float32, and the update rounded back into the bucket. A sparse
    # gradient's bucket (nn.Embedding(sparse=True): DDP gives each its own, a sparse COO
    # tensor) is reduced as its dense gradient, and the update goes back to DDP as a sparse
    # tensor of the bucket's layout. The widening and the dense copy (n floats) can fail on
    # one rank alone (out of memory): the error joins the ranks' agreement (the step's, or
    # the warm-up's), so that every rank raises it alike
    torch = _torch()
    work = buf
    sparse = buf.layout == torch.sparse_coo
    try:
        if sparse and error is None:
            work = buf.to_dense()  # (duplicate indices summed)
        if work.dtype == torch.bfloat16 and error is None:
            work = work.float()
    except Exception as exc:  # (shared with every rank: none is left waiting)
        error = exc
    try:
        if red is None:
            _reduce_dense(state, work, error, label)
        else:
            if error is not None:
                red._fail_step(error)  # (raises, on every rank)
            red.step(work, out=work)  # the update overwrites the gradient in place
    except NonFiniteError:  # (raised on every rank alike: every rank fills alike)
        state._failed.add(iteration)
        if state.nonfinite != "nan":
            raise
        work.fill_(float("nan"))
    except Exception:  # (agreed errors: raised on every rank alike)
        state._failed.add(iteration)
        raise
    else:
        if red is not None:
            state._stepped.append((iteration, red))
    if sparse:  # (DDP copies it into the gradient: the same sparse and dense dimensions)
        return work.to(buf.dtype).to_sparse(buf.sparse_dim())
    if work is not buf:
        buf.copy_(work)
    return buf


def _reduce_dense(
    state: SparseHookState, work: Any, error: BaseException | None, label: str
) -> None:
    """Overwrite ``work`` with its average over the ranks (the warm-up), after the ranks
    agree that every one has its bucket ready (``error``: this rank's failure to). Watched
    as a blocking call (with the watchdog on) under ``label``, as a bucket's step is: a
    rank that skipped a warm-up iteration left the others waiting for ever."""
    arr, wide, sig = None, None, None
    if error is None:
        try:
            arr, _ = as_array(work, "bucket", writable=True)
            state.comm.check_buffer(arr, "bucket")  # (an NCCLCommunicator's GPU)
            sig = [int(arr.size), VALUE_DTYPES.index(arr.dtype), WARMUP_MARK]
            wide = widening_buffer(arr)  # (float16: the float32 array it is summed in)
        except Exception as exc:  # (shared with every rank: none is left waiting)
            error = exc
    # (the check and the allreduce as one: another thread between them matched messages)
    with state.comm.serial(), watch(state.comm, label):
        collective_check(state.comm, error, sig, HOOK_AGREED)
        # on the bucket's GPU: the asynchronous hook runs this on the progress thread, whose
        # current device is 0 (as every new CUDA host thread's)
        with device_scope(arr), state.comm.measure() as st:
            # the bucket's average overwrites it (float16: taken in float32, no overflow of a
            # sum whose average fits)
            state.comm.allreduce(arr, out=arr, op="mean", check=False, work=wide)
            if is_device_array(arr):
                # its last writes (the mean, a float16 cast) are kernels on CuPy's stream into
                # torch's memory: nothing orders torch's stream after them, so wait (as
                # GradientReducer.step does for a foreign out)
                synchronize()
        _add_totals(state._outside_stats, st)


def _bucket_reducer(
    state: SparseHookState, bucket: Any
) -> tuple[GradientReducer | None, BaseException | None]:
    """The bucket's reducer (None during the warm-up, or when this rank failed to build it)
    and this rank's error in building it; counts the iteration on its last bucket. Building
    it can fail on one rank alone (memory running out for the copy of a restored state, or
    of the state carried to a new density): the error goes to the bucket's agreement, so
    that every rank raises it (raised here, the other ranks waited in the step for ever).
    Raises what every rank raises alike, before counting the bucket (the launch check)."""
    buf = bucket.buffer()
    red, error = None, None
    state._check_launch()  # (raised before the bucket is counted: every bucket raises it)
    try:
        if state.iteration >= state.warmup:
            numel, dtype = int(buf.numel()), str(buf.dtype)
            red = state.reducer(bucket.index(), numel, dtype, bucket.parameters())
    except Exception as exc:  # (shared with every rank: none is left waiting)
        error = exc
    if bucket.is_last():
        state.iteration += 1
    return red, error


# DDP checks a hook's annotations against dist.GradBucket / Future[Tensor] at registration;
# bucket and return stay unannotated so that torch need not be imported to define the hook.
def sparse_allreduce_hook(state: SparseHookState, bucket):
    """DDP communication hook: average the bucket's gradients with sparse allreduce.

    Returns a completed ``torch.futures.Future`` holding the bucket's buffer, overwritten
    with the averaged update (the same on every rank).
    """
    torch = _torch()
    buf = bucket.buffer()
    fut = torch.futures.Future()
    iteration, last = state.iteration, bucket.is_last()
    try:
        red, error = _bucket_reducer(state, bucket)
        label = _label(state, bucket, red, iteration)
        out = _reduce_bucket(state, buf, red, iteration, last, label, error)
    except Exception as exc:
        # raised inside the hook, the error leaves DDP's reducer mid-iteration (the next
        # forward fails an internal assertion): like the asynchronous hook, hand it over in
        # the future, so that it reaches backward() after every bucket came by
        fut.set_exception(exc)
        return fut.then(_value)
    fut.set_result(out)
    return fut


def async_sparse_allreduce_hook(state: SparseHookState, bucket):
    """DDP communication hook, overlapping: like :func:`sparse_allreduce_hook`, but the
    bucket is reduced on the communicator's progress thread while backward goes on.

    Returns a pending ``torch.futures.Future``, completed from the progress thread with the
    bucket's buffer (overwritten with the averaged update) or with the reduction's error.
    DDP lends the bucket's buffer until the future completes. Buckets are reduced in the
    order DDP hands them over (the same on every rank); warm-up iterations too.
    """
    torch = _torch()
    buf = bucket.buffer()
    iteration, last = state.iteration, bucket.is_last()
    red, error, refused = None, None, None
    try:
        red, error = _bucket_reducer(state, bucket)
    except Exception as exc:  # (raised in turn, as a reduction's error, on every rank)
        refused = exc
    fut = torch.futures.Future()

    def run() -> None:
        try:
            if refused is not None:
                raise refused
            out = _reduce_bucket(state, buf, red, iteration, last, label, error)
        except BaseException as exc:
            # DDP's backward raises as soon as it sees a failed future, with the later
            # buckets still queued here (they would then write into buffers DDP has given
            # to the next iteration): the error waits for the iteration's last bucket
            state._failures.append((fut, exc))
            raise
        else:
            fut.set_result(out)
        finally:
            if last:
                failures, state._failures = state._failures, []
                for failed, exc in failures:
                    failed.set_exception(exc)

    label = _label(state, bucket, red, iteration)
    state.comm.engine(label).submit(run, label, owner=state.comm)
    # DDP reads the future's value in C++: a future completed by set_exception holds the
    # exception as its value ("Unable to cast <message> to Tensor"); chained, the error
    # reaches backward() as an error, with its type and message
    return fut.then(_value)


def _label(state: SparseHookState, bucket: Any, red: Any, iteration: int) -> str:
    """The bucket's reduction as the watchdog names it."""
    what = "dense warm-up" if red is None else repr(state.algorithm)
    return f"ddp bucket {bucket.index()} ({what}, iteration {iteration})"


def _value(fut: Any) -> Any:
    return fut.value()  # raises the reduction's error
