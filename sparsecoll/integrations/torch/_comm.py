"""TorchCommunicator: sparsecoll's transport over a torch.distributed process group.

Every algorithm runs over torch's own transports, e.g. under ``torchrun`` with no MPI::

    dist.init_process_group("gloo")            # or "cpu:gloo,cuda:nccl"
    out = sparsecoll.allreduce(TorchCommunicator(), values, indices, n=n)

It is a :class:`~sparsecoll.Communicator` whose primitives are torch calls on the group's
CPU backend (gloo): point-to-point ``isend``/``irecv`` (tags kept), ``all_to_all_single``
(alltoallv; allgatherv as an alltoallv of this rank's part to every rank), ``all_reduce``
and ``broadcast``; numpy buffers go as ``torch.from_numpy`` views (no copy). When the
group's CUDA backend is NCCL, device (CuPy) payloads of allgatherv, alltoallv and allreduce
go to it as they are; all else (metadata, point-to-point, device buffers on a gloo group)
goes through host memory.

Torch has no probe: every point-to-point message is an int64 length header, then its
payload (none when empty), on the same tag, so a receive of unknown length
(``recv_bytes``) reads the header first. Byte accounting follows the MPI rules, counting
what the calls move: the payloads (self excluded), the headers as metadata, allgatherv as
the alltoallv it is ((P-1) copies of this rank's part sent). Messages to self never reach
torch (gloo cannot send to itself): they wait here, in order, per tag.

Input agreement (:mod:`sparsecoll._agree`) runs over it: one rank's bad input raises the
same error on every rank. Nonblocking calls (:func:`sparsecoll.iallreduce`, the training
reducer's) run on a progress thread over a new group of the same processes, made at the
first one (every process of the group makes it, in the same order). Not supported
(NotImplementedError): the watchdog on blocking calls (it needs MPI's probe); the process
group's own timeout bounds a hung call instead.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..._agree import start_vote
from ..._array import get_array_module
from ..._buffers import recv_view, send_view
from ..._polling import Request
from ..._progress import Engine
from ..._routing import routed
from ..._timeout import get_timeout
from ...comm import CommStats, Communicator
from ._group import torch_module

__all__ = ["TorchCommunicator"]

_HEADER = 8  # bytes of a point-to-point message's length header
_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()


class _Works:
    """The pending torch Works of one request (what :class:`Request` waits on)."""

    __slots__ = ("works",)

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def Wait(self) -> None:  # (the name Request calls, as on an MPI request)
        for w in self.works:
            w.wait()

    def Test(self) -> bool:
        return all(w.is_completed() for w in self.works)


class _Ready:
    """A duplicate made already (what an engine's start completes with ``get()``)."""

    __slots__ = ("comm",)

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    def get(self, poll: bool = True) -> Any:
        return self.comm


class TorchRequest(Request):
    """A pending send or receive on a TorchCommunicator (its Works complete one by one)."""

    __slots__ = ()


class TorchCommunicator(Communicator):
    """Run sparsecoll's algorithms over a ``torch.distributed`` process group.

    ``group``: a ProcessGroup with a CPU backend (gloo), default the default group (made
    by ``dist.init_process_group``); ``rank`` and ``size`` are this process's within it.
    Raises RuntimeError when torch.distributed is not initialized, ValueError for a group
    this process is not in or without a CPU backend.
    """

    def __init__(self, group: Any = None) -> None:  # (no MPI: Communicator's own is skipped)
        torch = torch_module()
        dist = torch.distributed
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: call dist.init_process_group() first"
            )
        if group is None:
            group = dist.group.WORLD
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError("this process is not a member of the process group")
        config = str(dist.get_backend_config(group))
        backends = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
        if "cpu" not in backends:
            raise ValueError(
                f"a TorchCommunicator needs a CPU backend (gloo) for its metadata, got "
                f"{config!r}: e.g. dist.init_process_group('cpu:gloo,cuda:nccl')"
            )
        self._torch, self._dist = torch, dist
        self.group = group
        self.backend_config = config
        self.mpi_comm = None  # (no MPI communicator below it)
        self.rank: int = dist.get_rank(group)
        self.size: int = dist.get_world_size(group)
        self.stats = CommStats()
        self._last = threading.local()
        self._stats_lock = threading.Lock()
        self._scopes = threading.local()
        self._cuda_aware = backends.get("cuda") == "nccl"  # device collectives on NCCL
        self._engine = None
        self._lock = None
        self._internal = False
        self.poll = False  # (torch's waits release the GIL)
        self._to_self: dict[int, deque[Any]] = {}  # messages to self, by tag

    def __repr__(self) -> str:
        return (
            f"<sparsecoll.TorchCommunicator rank {self.rank} of {self.size} on "
            f"{self.backend_config}>"
        )

    # -- the progress engine -------------------------------------------------------------
    def engine(self, call: str | None = None, *, blocking: bool = False) -> Any:
        """The progress engine of this communicator, started (collectively) on first use:
        its calls run on a TorchCommunicator of a new group of the same processes
        (:meth:`duplicate`), apart from the user's calls on this one. Watching blocking
        calls (``blocking``) raises NotImplementedError: it needs MPI's probe."""
        if blocking:
            raise NotImplementedError(
                "the watchdog (SPARSECOLL_TIMEOUT) on blocking calls needs MPI: not "
                "supported on a TorchCommunicator (the process group's timeout bounds its "
                "calls); unset it, or use a Communicator under mpiexec"
            )
        if self._engine is None:
            with self._own_lock():  # (one start, whichever threads ask at once)
                if self._engine is None:
                    self._engine = self._start_engine(call)
        return self._engine

    def _start_engine(self, call: str | None) -> Any:
        """The engine's start vote (:func:`~sparsecoll._agree.start_vote`) and the new
        group, in order with this thread's calls; the vote settled on the engine's thread
        (no alarm communicator: the watchdog's abort is this rank's alone)."""
        vote = start_vote(self, call, False)
        dup = self.duplicate()

        def start() -> tuple[Any, Any]:
            vote.settle(dup)
            return dup.get(), None

        return Engine(self.rank, self.size, start, abort=self.abort)

    def duplicate(self) -> Any:
        """A TorchCommunicator of a new group of this one's processes, in its order (gloo;
        NCCL for CUDA where this one has it), ready at ``.get()``: made now, collectively
        over this group's processes (``new_group(use_local_synchronization=True)``)."""
        ranks = [int(r) for r in self._dist.get_process_group_ranks(self.group)]
        backend = "cpu:gloo,cuda:nccl" if self._cuda_aware else "gloo"
        group = self._dist.new_group(
            ranks, backend=backend, use_local_synchronization=True, sort_ranks=False
        )
        dup = TorchCommunicator(group)
        dup._internal = True
        return _Ready(dup)

    def try_recv_ints(self, tag: int) -> Any:
        raise NotImplementedError("a TorchCommunicator cannot probe for messages")

    def _attached_engine(self) -> Any:
        return self._engine

    def on_progress_thread(self) -> bool:
        """Whether the calling thread is this communicator's progress thread. A watched
        blocking call (the watchdog on) elsewhere asks this first: it is refused here,
        before anything would load MPI."""
        if self._engine is not None and self._engine.is_worker_thread():
            return True
        if get_timeout():
            self.engine(blocking=True)  # (raises NotImplementedError)
        return False

    def _own_lock(self) -> Any:
        if self._lock is None:
            with _LOCKS_LOCK:  # (one lock per group, shared by its TorchCommunicators)
                self._lock = _LOCKS.setdefault(self.group, threading.RLock())
        return self._lock

    @contextlib.contextmanager
    def apart(self) -> Iterator[None]:
        """The algorithms' messages travel on the group itself: leave no point-to-point
        message of your own pending on it across a sparsecoll call."""
        yield

    def abort(self, code: int = 1) -> None:
        """End this process (torchrun then ends the job's other processes)."""
        import os
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    @property
    def cuda_aware(self) -> bool:
        """Whether device payloads of collectives go to the group's CUDA backend (NCCL)
        as they are (else they are staged through host memory)."""
        return self._cuda_aware

    @cuda_aware.setter
    def cuda_aware(self, value: bool) -> None:
        self._cuda_aware = bool(value)

    @staticmethod
    def wtime() -> float:
        return time.perf_counter()

    # -- tensors -----------------------------------------------------------------------------
    def _tensor(self, view: Any) -> Any:
        """A torch tensor over the memory of a numpy or CuPy array (no copy)."""
        if isinstance(view, np.ndarray):
            with warnings.catch_warnings():  # (a read-only send buffer: torch only reads it)
                warnings.simplefilter("ignore", UserWarning)
                return self._torch.from_numpy(view)
        return self._torch.as_tensor(view, device=f"cuda:{view.device.id}")

    def _synchronize(self, view: Any) -> None:
        """Wait for torch's CUDA stream to finish with a device view (host: nothing)."""
        if not isinstance(view, np.ndarray):
            self._torch.cuda.current_stream(view.device.id).synchronize()

    # -- point-to-point ------------------------------------------------------------------------
    def _post_send(self, buf: Any, dest: int, tag: int) -> list[Any]:
        """Start sending ``buf``'s bytes (header, then payload): the Works to wait for."""
        view = send_view(buf, False)
        if dest == self.rank:
            self._to_self.setdefault(tag, deque()).append(view.copy())
            return []
        head = self._torch.tensor([view.shape[0]], dtype=self._torch.int64)
        works = [self._dist.isend(head, group=self.group, group_dst=dest, tag=tag)]
        if view.shape[0]:
            works.append(
                self._dist.isend(self._tensor(view), group=self.group, group_dst=dest, tag=tag)
            )
        self._meta(_HEADER, 1)
        return works

    def _from_self(self, tag: int) -> Any:
        queue = self._to_self.get(tag)
        if not queue:
            raise RuntimeError(f"a receive from self (tag {tag}) with no message sent to self")
        return queue.popleft()

    def _post_recv(self, buf: Any, source: int, tag: int) -> TorchRequest:
        """Start receiving into ``buf`` (its size known): the request, which checks the
        header's length and completes a staged device buffer."""
        view, finish = recv_view(buf, False)
        expected = int(view.shape[0])
        if source == self.rank:

            def from_self() -> None:
                got = self._from_self(tag)
                _check_length(got.shape[0], expected, source, tag)
                view[...] = got
                if finish:
                    finish()

            return TorchRequest(_Works([]), from_self)
        head = self._torch.empty(1, dtype=self._torch.int64)
        works = [self._dist.irecv(head, group=self.group, group_src=source, tag=tag)]
        if expected:
            works.append(
                self._dist.irecv(self._tensor(view), group=self.group, group_src=source, tag=tag)
            )

        def complete() -> None:
            _check_length(int(head[0]), expected, source, tag)
            if finish:
                finish()

        return TorchRequest(_Works(works), complete, keep=(head, view))

    @routed
    def send(self, buf: Any, dest: int, tag: int = 0) -> None:
        for w in self._post_send(buf, dest, tag):
            w.wait()
        self._count_send(buf, dest)

    @routed
    def recv(self, buf: Any, source: int, tag: int = 0) -> None:
        self._post_recv(buf, source, tag).wait()
        self._count_recv(buf, source)

    @routed
    def isend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        view = send_view(buf, False)  # (kept alive until the request completes)
        works = self._post_send(view, dest, tag)
        self._count_send(buf, dest)
        return TorchRequest(_Works(works), keep=view)

    @routed
    def irecv(self, buf: Any, source: int, tag: int = 0) -> Request:
        req = self._post_recv(buf, source, tag)
        self._count_recv(buf, source)
        return req

    @routed
    def sendrecv(self, sendbuf: Any, dest: int, recvbuf: Any, source: int, tag: int = 0) -> None:
        req = self._post_recv(recvbuf, source, tag)
        for w in self._post_send(sendbuf, dest, tag):
            w.wait()
        req.wait()
        self._count_send(sendbuf, dest)
        self._count_recv(recvbuf, source)

    @routed
    def recv_bytes(self, source: int, tag: int = 0, xp: Any = np) -> Any:
        """Receive a message of unknown length from ``source`` as a uint8 array of module
        ``xp`` (its header first, then the payload)."""
        if source == self.rank:
            got = self._from_self(tag)
            return got if xp is np else xp.asarray(got)
        head = self._torch.empty(1, dtype=self._torch.int64)
        self._dist.recv(head, group=self.group, group_src=source, tag=tag)
        buf = xp.empty(int(head[0]), dtype=np.uint8)
        view, finish = recv_view(buf, False)
        if view.shape[0]:
            self._dist.recv(self._tensor(view), group=self.group, group_src=source, tag=tag)
        if finish:
            finish()
        self._count_recv(buf, source)
        return buf

    @routed
    def sendrecv_ints(self, values: int | Sequence[int], dest: int, source: int, tag: int = 0):
        scalar = np.ndim(values) == 0
        a = np.atleast_1d(np.asarray(values, dtype=np.int64))
        out = np.empty_like(a)
        req = self._post_recv(out, source, tag)
        for w in self._post_send(a, dest, tag):
            w.wait()
        req.wait()
        if dest != self.rank:
            self._meta(a.nbytes, 1)
        return int(out[0]) if scalar else out.tolist()

    # -- payload collectives ---------------------------------------------------------------
    def _alltoallv_bytes(self, send: Any, recv: Any, sb: list[int], rb: list[int]) -> None:
        """all_to_all_single of the byte views ``send`` and ``recv`` (host, or device on a
        NCCL group), ``sb[j]`` bytes to rank j and ``rb[j]`` from it."""
        out, inp = self._tensor(recv), self._tensor(send)
        self._dist.all_to_all_single(out, inp, rb, sb, group=self.group)
        self._synchronize(recv)

    @routed
    def allgatherv(
        self, sendbuf: Any, counts: Sequence[int] | None = None
    ) -> tuple[Any, list[int]]:
        """Gather every rank's 1-D ``sendbuf`` (concatenated in rank order) on every rank:
        an alltoallv of ``sendbuf`` to every rank. ``counts`` (elements per rank) may be
        given when every rank knows them. Returns ``(recvbuf, counts)``."""
        if counts is None:
            counts = self.allgather_ints(int(sendbuf.shape[0]))
        counts = [int(c) for c in counts]
        out = get_array_module(sendbuf).empty(sum(counts), dtype=sendbuf.dtype)
        if self.size == 1:
            out[...] = sendbuf
            return out, counts
        item = sendbuf.dtype.itemsize
        mine = send_view(sendbuf, self.cuda_aware)
        xp = get_array_module(mine)
        sb = [int(mine.shape[0])] * self.size
        rb = [c * item for c in counts]
        rview, finish = recv_view(out, self.cuda_aware)
        self._alltoallv_bytes(xp.tile(mine, self.size), rview, sb, rb)
        if finish:
            finish()
        self._count_alltoallv(sb, rb)
        return out, counts

    @routed
    def alltoallv(self, sendbuf: Any, sendcounts: Sequence[int]) -> tuple[Any, list[int]]:
        """Send ``sendcounts[j]`` consecutive elements of ``sendbuf`` to rank j; returns
        ``(recvbuf, recvcounts)`` (bad counts on any rank raise on every rank, as
        :meth:`Communicator.alltoallv`)."""
        sendcounts, recvcounts = self._alltoallv_counts(sendbuf, sendcounts)
        out = get_array_module(sendbuf).empty(sum(recvcounts), dtype=sendbuf.dtype)
        item = sendbuf.dtype.itemsize
        sb = [c * item for c in sendcounts]
        rb = [c * item for c in recvcounts]
        send = send_view(sendbuf, self.cuda_aware)[: sum(sb)]
        rview, finish = recv_view(out, self.cuda_aware)
        self._alltoallv_bytes(send, rview, sb, rb)
        if finish:
            finish()
        self._count_alltoallv(sb, rb)
        return out, recvcounts

    def _allreduce_into(self, work: Any, dest: Any, op: str) -> None:
        """The sum (or mean) of ``work`` in ``dest`` (``work`` itself: in place), as
        :meth:`Communicator.allreduce` asks, by torch's all_reduce."""
        if dest is not work:
            dest[...] = work
        if self.size > 1:
            view, finish = recv_view(dest, self.cuda_aware)
            if finish and view.shape[0]:  # staged through the host: stage the input
                dest.reshape(-1).view(np.uint8).get(out=view)
            typed = view.view(dest.dtype)
            self._dist.all_reduce(self._tensor(typed), group=self.group)
            self._synchronize(typed)
            if finish:
                finish()
            self._count_allreduce(work.nbytes)
            if op == "mean":
                dest /= self.size

    # -- metadata (small, host) ------------------------------------------------------------
    def _reduce_op(self, op: str) -> Any:
        ops = self._dist.ReduceOp
        return {"sum": ops.SUM, "max": ops.MAX, "min": ops.MIN}[op]

    def _allreduce_meta(self, values: Any, dtype: Any, op: str) -> np.ndarray:
        out = np.array(values, dtype=dtype, copy=True, ndmin=1)
        self._dist.all_reduce(self._tensor(out), op=self._reduce_op(op), group=self.group)
        self._meta(2 * out.nbytes, 2 * self._log2())
        return out

    @routed
    def iallreduce_ints(
        self, values: Sequence[int], op: str = "sum", poll: bool | None = None
    ) -> tuple[Request, Any]:
        """Start reducing a small int64 vector over all ranks: ``(request, out)``."""
        out = np.array(values, dtype=np.int64, copy=True, ndmin=1)
        t = self._tensor(out)
        work = self._dist.all_reduce(t, op=self._reduce_op(op), group=self.group, async_op=True)
        self._meta(2 * out.nbytes, 2 * self._log2())
        return TorchRequest(_Works([work]), keep=t), out

    @routed
    def allgather_ints(self, value: int | Sequence[int]) -> Any:
        """Gather one int (or a fixed-length int vector) from every rank: list or (P, m) array."""
        scalar = np.ndim(value) == 0
        a = np.ascontiguousarray(np.atleast_1d(np.asarray(value, dtype=np.int64)))
        out = np.empty((self.size, a.shape[0]), dtype=np.int64)
        self._dist.all_gather_single(self._tensor(out.reshape(-1)), self._tensor(a), self.group)
        self._meta(a.nbytes * (self.size - 1), self._log2())
        return out[:, 0].tolist() if scalar else out

    @routed
    def alltoall_ints(self, values: Sequence[int]) -> list[int]:
        """Send ``values[j]`` to rank j; return what every rank sent to this one."""
        a = np.ascontiguousarray(values, dtype=np.int64)
        out = np.empty_like(a)
        self._dist.all_to_all_single(self._tensor(out), self._tensor(a), group=self.group)
        self._meta(a.nbytes * (self.size - 1) // max(self.size, 1), self.size - 1)
        return out.tolist()

    @routed
    def bcast_object(self, obj: Any, root: int) -> Any:
        """Broadcast a small picklable object (error reports, configuration)."""
        data = pickle.dumps(obj) if self.rank == root else b""
        size = np.array([len(data)], dtype=np.int64)
        self._dist.broadcast(self._tensor(size), group=self.group, group_src=root)
        buf = np.frombuffer(data, np.uint8).copy() if self.rank == root else None
        buf = buf if buf is not None else np.empty(int(size[0]), dtype=np.uint8)
        if buf.shape[0]:
            self._dist.broadcast(self._tensor(buf), group=self.group, group_src=root)
        return pickle.loads(buf.tobytes())

    @routed
    def allgather_object(self, obj: Any) -> list[Any]:
        """Gather a small picklable object from every rank."""
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        sizes = np.empty(self.size, dtype=np.int64)
        mine = self._tensor(np.array([data.shape[0]], dtype=np.int64))
        self._dist.all_gather_single(self._tensor(sizes), mine, self.group)
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        self._alltoallv_bytes(
            np.tile(data, self.size), out, [data.shape[0]] * self.size, sizes.tolist()
        )
        displs = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        return [pickle.loads(out[d : d + c].tobytes()) for d, c in zip(displs, sizes)]

    @routed
    def barrier(self) -> None:
        zero = self._torch.zeros(1, dtype=self._torch.int64)  # (on the CPU backend)
        self._dist.all_reduce(zero, group=self.group)


def _check_length(got: int, expected: int, source: int, tag: int) -> None:
    if got != expected:
        raise RuntimeError(
            f"message from rank {source} (tag {tag}) has {got} bytes, the receive expects "
            f"{expected}"
        )
