"""The "sparsecoll" torch.distributed backend: a Python ``ProcessGroup`` whose sparse COO
all-reduces run a sparsecoll exact algorithm and whose dense collectives are gloo's (NCCL's
for CUDA tensors, where torch has it).

:func:`register` makes ``dist.init_process_group("sparsecoll")`` build a
:class:`SparseProcessGroup` (the creator gets the group's store, rank, size and timeout).
The sparse transport is MPI when every rank was started by mpiexec as one MPI job whose
ranks are torch's, else a :class:`~._comm.TorchCommunicator` over this group itself
(``pg_options={"transport": ...}`` or ``SPARSECOLL_TORCH_TRANSPORT`` forces one). Over MPI,
sparse all-reduces run on the communicator's progress thread, one after the other in call
order; over torch, in the calling thread, their messages on the dense group in program
order with the dense calls (so every rank issues gloo's calls in the same order). The
algorithm: ``pg_options``' ``"algorithm"``, else ``SPARSECOLL_TORCH_ALGORITHM``, else
``auto``; the other keys of ``pg_options`` are its options.

Every all_reduce first agrees on the tensor's kind, shape, dtype, op and device
(:mod:`._vote`): the ranks take the same path, or all raise the same error. Over MPI the
agreements run on a communicator of their own, and the group's timeout is the watchdog's
limit on it and on the sparse calls' (the smaller of it and ``SPARSECOLL_TIMEOUT``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from ..._launch import under_mpi
from ...api import allreduce
from ...comm import Communicator
from ...errors import SparseCollError
from ...registry import get_algorithm
from ._coo import check_coo, from_coo, to_coo
from ._group import world_subset
from ._vote import GlooVotes, call_check

__all__ = ["ENV_ALGORITHM", "ENV_TRANSPORT", "FutureWork", "SparseProcessGroup", "register"]

NAME = "sparsecoll"
ENV_ALGORITHM = "SPARSECOLL_TORCH_ALGORITHM"
ENV_TRANSPORT = "SPARSECOLL_TORCH_TRANSPORT"
TRANSPORTS = ("mpi", "torch")
_DTYPES = (torch.float16, torch.float32, torch.float64, torch.bfloat16)
_OPS = {dist.ReduceOp.SUM: "SUM", dist.ReduceOp.AVG: "AVG"}


def _op_name(op: Any) -> str:
    for known, name in _OPS.items():
        if op == known:
            return name
    return str(getattr(op, "op", op)).rsplit(".", 1)[-1]


class FutureWork(dist._Work):
    """A Work done when ``future`` is: ``wait()`` raises the future's error (the Work that
    ``_create_work_from_future`` makes returns True), ``result()`` is its value."""

    def __init__(self, future: Any) -> None:
        super().__init__()
        self.future = future

    def wait(self, timeout: Any = None) -> bool:
        self.future.wait()
        return True

    def is_completed(self) -> bool:
        return bool(self.future.done())

    def get_future(self) -> Any:
        return self.future

    def result(self) -> Any:
        return self.future.value()


class SparseProcessGroup(dist.ProcessGroup):
    """A process group of ``size`` ranks: sparse all-reduce by sparsecoll, the rest by the
    dense groups (``{"cpu": gloo, "cuda": nccl}``) it delegates to."""

    def __init__(
        self, rank: int, size: int, dense: dict[str, Any], comm: Any, options: dict, votes: Any
    ):
        super().__init__(rank, size)
        self._dense, self._comm, self._votes = dense, comm, votes
        options = dict(options)
        chosen = options.pop("algorithm", None) or os.environ.get(ENV_ALGORITHM)
        self.algorithm = str(chosen or "auto")
        self.algorithm_options = options
        self._algorithms: dict[tuple, Any] = {}  # one instance per (shape, dtype): auto's state
        self._threaded: bool | None = None
        self._watched: bool | None = None  # whether the votes' engine watches them
        self._inner = threading.local()  # .on: in a sparse reduction (its calls are agreed)

    @property
    def comm(self) -> Any:
        """The sparse transport: an MPI Communicator, or a TorchCommunicator of this group
        (made at the first sparse call: torch registers the group after its creator)."""
        if self._comm is None:
            from ._comm import TorchCommunicator

            self._comm = TorchCommunicator(self)
        return self._comm

    def shutdown(self) -> None:
        """Free this group's MPI communicators (their progress threads end after the calls
        queued there) and shut its dense groups down; ``destroy_process_group`` calls it."""
        comms, self._comm = (self._comm, self._votes), None
        for comm in comms:
            mpi_comm = getattr(comm, "mpi_comm", None)
            if mpi_comm is not None:
                mpi_comm.Free()
        for backend in self._dense.values():
            backend.shutdown()

    def getBackendName(self) -> str:
        return NAME

    def __repr__(self) -> str:
        return f"SparseProcessGroup(rank={self.rank()}, size={self.size()}, {self.algorithm!r})"

    def _group(self, tensors: Any) -> Any:
        """The dense group of the first tensor's device in ``tensors`` (nested lists)."""
        while isinstance(tensors, (list, tuple)) and tensors:
            tensors = tensors[0]
        kind = tensors.device.type if isinstance(tensors, torch.Tensor) else "cpu"
        try:
            return self._dense[kind]
        except KeyError:
            raise ValueError(f"the sparsecoll backend has no {kind} transport") from None

    def allreduce(self, tensors: list[Any], opts: Any) -> Any:
        if getattr(self._inner, "on", False):  # the sparse transport's own (agreed) calls
            return self._dense_allreduce(tensors, opts)
        op = _op_name(opts.reduceOp)
        kind = "sparse" if tensors and tensors[0].layout == torch.sparse_coo else "dense"
        label = f"all_reduce({kind} tensor of shape {tuple(tensors[0].shape) if tensors else ()})"
        try:
            with self._watch(label):
                algo = call_check(
                    self._votes, tensors, op, lambda t: self._local_check(t, op), label
                )
        except SparseCollError as exc:  # (agreed: every rank's Work fails alike)
            fut: Any = Future()
            fut.set_exception(exc)
            return FutureWork(fut)
        if algo is None:
            return self._dense_allreduce(tensors, opts)
        return self._sparse_allreduce(tensors[0], op, algo, label)

    def _watch(self, label: str) -> Any:
        """Around an all_reduce's agreement: over MPI, watched by its communicator's
        engine (the group's timeout: a rank that skips the call ends the job with the
        watchdog's diagnostic); gloo's votes have the group's timeout as their own."""
        if self._watched is None:
            try:  # (alike on every rank: the thread level; the start is collective)
                self._votes.engine(label, blocking=True)
                self._watched = True
            except (AttributeError, RuntimeError):
                self._watched = False
        if not self._watched:
            return contextlib.nullcontext()
        return self._votes.engine(label, blocking=True).watching(label)

    def _dense_allreduce(self, tensors: list[Any], opts: Any) -> Any:
        if opts.reduceOp == dist.ReduceOp.AVG:  # (gloo has none: a sum, then divided)
            total = dist.AllreduceOptions()
            total.reduceOp, total.timeout = dist.ReduceOp.SUM, opts.timeout
            work = self._group(tensors).allreduce(tensors, total)
            size = self.size()

            def divide(fut: Any) -> Any:
                for t in fut.value():
                    t.div_(size)
                return fut.value()

            return FutureWork(work.get_future().then(divide))
        return self._group(tensors).allreduce(tensors, opts)

    def _local_check(self, t: Any, op: str) -> Any:
        """This rank's checks of a sparse all_reduce of ``t``: the algorithm that reduces
        it."""
        if op not in ("SUM", "AVG"):
            raise ValueError(f"sparse all_reduce takes SUM or AVG, got {op}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"sparse all_reduce takes float tensors, got {t.dtype}")
        if t.device.type != "cpu":
            raise ValueError(f"sparse all_reduce takes CPU tensors, got one on {t.device}")
        check_coo(t)
        return self._algorithm(tuple(t.shape), t.dtype)

    def _sparse_allreduce(self, t: Any, op: str, algo: Any, label: str) -> Any:
        """Reduce ``t`` over the ranks on the progress thread; a Work whose result is
        ``[t]``, overwritten with the coalesced sum (mean for AVG), as gloo's."""
        fut: Any = Future()

        def run() -> None:
            self._inner.on = True
            try:
                out = self._reduce(t, op, algo)
                with torch.no_grad():
                    t.copy_(out)
            except BaseException as exc:  # (the reduction's errors are agreed: every rank's)
                fut.set_exception(exc)
            else:
                fut.set_result([t])
            finally:
                self._inner.on = False

        if self._threaded is None:  # (over torch: inline, its messages in program order)
            try:  # (below MPI_THREAD_MULTIPLE every rank's raises alike: each runs inline)
                self._threaded = self.comm.mpi_comm is not None and bool(self.comm.engine(label))
            except (RuntimeError, NotImplementedError):
                self._threaded = False
        if self._threaded:
            self.comm.engine(label).submit(run, label, owner=self.comm)
        else:
            run()
        return FutureWork(fut)

    def _reduce(self, t: Any, op: str, algo: Any) -> Any:
        """The reduced tensor of ``t``'s layout (the ranks agreed on its kind, shape, dtype
        and op)."""
        values, indices, n = to_coo(t, as_rows=type(algo).takes_rows)
        out = allreduce(self.comm, values, indices, n=n, algorithm=algo)
        if op == "AVG":
            out.values /= self.size()
        return from_coo(out.values, out.indices, t)

    def _algorithm(self, shape: tuple, dtype: Any) -> Any:
        key = (shape, dtype)
        if key not in self._algorithms:
            algo = get_algorithm(self.algorithm, **self.algorithm_options)
            if not algo.exact:
                raise ValueError(
                    f"the sparsecoll backend needs an exact algorithm (all_reduce returns the "
                    f"sum), got {self.algorithm!r}"
                )
            self._algorithms[key] = algo
        return self._algorithms[key]


def _delegate(name: str, backend_name: str) -> Any:
    def method(self: SparseProcessGroup, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._group(args[:2]), backend_name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"``{backend_name}`` of the dense group of the tensors' device."
    return method


# torch's ProcessGroup names (what torch.distributed calls) -> its Backend's (gloo's, NCCL's)
_DELEGATED = {
    name: name
    for name in (
        "_allgather_base",
        "_reduce_scatter_base",
        "allgather",
        "allgather_coalesced",
        "allgather_into_tensor_coalesced",
        "allreduce_coalesced",
        "alltoall",
        "alltoall_base",
        "barrier",
        "broadcast",
        "gather",
        "monitored_barrier",
        "recv",
        "recv_anysource",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor_coalesced",
        "scatter",
        "send",
    )
} | {
    "all_gather_single": "_allgather_base",
    "all_gather_single_coalesced": "allgather_into_tensor_coalesced",
    "all_to_all_single": "alltoall_base",
    "reduce_scatter_single": "_reduce_scatter_base",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
}
for _name, _backend_name in _DELEGATED.items():
    setattr(SparseProcessGroup, _name, _delegate(_name, _backend_name))


def _transport(store: Any, rank: int, size: int, ranks: list[int], forced: str | None) -> str:
    """ "mpi" or "torch", the same on every rank (each posts its own verdict on the store and
    reads the others'). MPI only when every rank was started by mpiexec in one MPI job
    whose world ranks are torch's global ranks."""
    if forced is not None and forced not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {forced!r}")
    mine = "torch"
    if forced != "torch" and under_mpi():
        from ..._mpilib import mpi

        world = mpi().COMM_WORLD
        me = ranks[rank] if ranks else rank
        total = dist.get_world_size() if ranks else size
        if (world.Get_size(), world.Get_rank()) == (total, me):
            mine = "mpi"
    store.set(f"sparsecoll/transport/{rank}", mine)
    every = [store.get(f"sparsecoll/transport/{r}").decode() for r in range(size)]
    if forced == "mpi" and any(v != "mpi" for v in every):
        bad = [r for r, v in enumerate(every) if v != "mpi"]
        raise RuntimeError(
            f"transport 'mpi' asked for, but ranks {bad} were not started by mpiexec as one "
            f"MPI job whose ranks are torch's (launch with mpiexec, or use transport 'torch')"
        )
    return "mpi" if all(v == "mpi" for v in every) else "torch"


def _mpi_comm(ranks: list[int]) -> Any:
    """A communicator of the group's processes in its order, apart from the user's."""
    from ..._mpilib import mpi

    if not ranks:
        return mpi().COMM_WORLD.Dup()
    return world_subset(ranks)


def _create(backend_opts: Any, options: Any) -> SparseProcessGroup:
    """torch's creator (extended API): ``options`` is ``init_process_group``'s
    ``pg_options``, None or a mapping."""
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise TypeError(f"pg_options must be a dict for sparsecoll, got {type(options).__name__}")
    options = dict(options)
    forced = options.pop("transport", None) or os.environ.get(ENV_TRANSPORT) or None
    store, rank, size = backend_opts.store, backend_opts.group_rank, backend_opts.group_size
    timeout = backend_opts.timeout
    ranks = list(backend_opts.global_ranks_in_group)
    dense: dict[str, Any] = {
        "cpu": dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
    }
    if torch.cuda.is_available() and dist.is_nccl_available():
        nccl = dist.ProcessGroupNCCL.Options()
        nccl._timeout = timeout
        dense["cuda"] = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, nccl)
    votes: Any = GlooVotes(dense["cpu"], rank, size)
    comm = None  # (over torch: a TorchCommunicator of the group, once torch has registered it)
    if _transport(store, rank, size, ranks, forced) == "mpi":
        # the sparse calls and the agreements, on two communicators: the watchdog's limit
        # on both is the group's timeout (or SPARSECOLL_TIMEOUT, when it is smaller)
        comm = Communicator(_mpi_comm(ranks))
        votes = Communicator(comm.mpi_comm.Dup())
        comm.timeout = votes.timeout = (timeout.total_seconds(), "the process group's timeout")
    return SparseProcessGroup(rank, size, dense, comm, options, votes)


def register() -> None:
    """Register the "sparsecoll" backend with torch.distributed (once; later calls do
    nothing)."""
    if NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])
