"""Communicator: sparsecoll's transport over one MPI communicator, with byte accounting.

Payload accounting, per rank (metadata such as counts and validation codes is kept apart
in the ``meta_*`` fields): point-to-point and ``alltoallv`` count the bytes sent and received
(self excluded); ``allgatherv`` what a ring allgather moves (every other rank's part, sent
and received; ``ceil(log2 P)`` messages); ``allreduce`` what a bandwidth-optimal allreduce
moves (``2 (P-1)/P`` of the buffer each way; ``2 ceil(log2 P)`` messages). Staging copies of
device buffers (:mod:`._buffers`) are not communication.

Threads: this rank's calls on one MPI communicator run one at a time (:meth:`serial`).
Once a progress engine is attached (:meth:`Communicator.engine`), a call from the engine's
thread runs on its duplicate, and a call from another thread first waits for every request
submitted before it. ``poll=True`` (or ``SPARSECOLL_POLL=1``) completes every operation by
Test calls with sleeps (:mod:`._polling`) instead of MPI's busy-polling blocking calls.
"""

from __future__ import annotations

import contextlib
import operator
import pickle
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from . import _keyvals, _mpilib
from ._accounting import Accounting, CommStats
from ._agree import agreement, share_error, start_vote, watch
from ._array import as_array, device_scope, get_array_module, is_device_array, wait_for_foreign
from ._buffers import (
    check_out,
    free_type,
    in_dtype,
    message,
    offsets,
    recv_view,
    send_view,
    sum_buffers,
    widening_buffer,
)
from ._large import allgatherv_by_bcast, alltoallv_by_pairs, alltoallv_past_limit
from ._mpilib import mpi_library_version, thread_multiple
from ._options import env_flag
from ._polling import Request, poll
from ._progress import Engine, starting
from ._routing import Apart, first_take, routed, thread_state
from .sparse import VALUE_DTYPES

__all__ = [
    "CommStats",
    "Communicator",
    "Request",
    "mpi_library_version",
    "thread_multiple",
    "widening_buffer",
]


class _Duplicate:
    """A duplicate of a communicator being made by ``MPI_Comm_idup`` (started on the
    calling thread, in order with its other calls there); :meth:`get` completes it."""

    __slots__ = ("_comm", "_req")

    def __init__(self, comm: Communicator, poll: bool | None = None) -> None:
        self._comm, req = comm.mpi_comm.Idup()  # (on the user's communicator, not apart)
        self._req = Request(req, poll=comm.poll if poll is None else poll)

    def get(self, poll: bool = True) -> Communicator:
        """The duplicate, once made, wrapped in a Communicator of sparsecoll's own."""
        self._req.wait()
        dup = Communicator(self._comm, poll=poll)
        dup._internal = True
        return dup


class Communicator(Accounting):
    """Wrap an mpi4py ``Intracomm`` (default: COMM_WORLD) for sparsecoll's algorithms.

    Buffers are numpy or CuPy arrays; point-to-point payloads travel as raw bytes, so any
    dtype (float16 included) passes unchanged. ``poll=True`` completes every operation by
    Test calls with sleeps in between instead of MPI's (busy-polling) blocking calls
    (default: ``SPARSECOLL_POLL=1`` in the environment).
    """

    def __init__(self, comm: Any = None, *, poll: bool | None = None) -> None:
        MPI = _mpilib.usable_mpi()
        if comm is None:
            comm = MPI.COMM_WORLD
        if isinstance(comm, Communicator):
            comm = comm.mpi_comm
        if comm == MPI.COMM_NULL:  # e.g. Split with MPI.UNDEFINED: this rank is not a member
            raise TypeError(
                "comm is MPI.COMM_NULL: this rank is not in the communicator, or it was freed"
            )
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(
                f"comm must be an mpi4py Intracomm or a sparsecoll.Communicator, "
                f"got {type(comm).__name__}"
            )
        self.mpi_comm = comm
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self.stats = CommStats()  # running totals: every call's traffic, requests' included
        self._last = threading.local()  # each thread's last_stats
        self._stats_lock = threading.Lock()  # (the progress thread adds its requests' traffic)
        self._scopes = threading.local()  # each thread's open measure() scopes
        self._cuda_aware: bool | None = None
        self._engine: Any = None  # the progress engine, once found (see _attached_engine)
        self._lock: Any = None  # see serial()
        self._internal = False  # a progress engine's own duplicate (see _watch_direct)
        self.timeout: tuple[float, str] | None = None  # the watchdog's own (_timeout.limit)
        self._apart = Apart()  # each thread's message communicator (see apart())
        self.poll = bool(env_flag("SPARSECOLL_POLL", False)) if poll is None else bool(poll)

    def __repr__(self) -> str:
        name = self.mpi_comm.Get_name() or type(self.mpi_comm).__name__
        return f"<sparsecoll.Communicator rank {self.rank} of {self.size} on {name}>"

    @classmethod
    def wrap(cls, comm: Any) -> Communicator:
        """Return ``comm`` if it already is a Communicator, else wrap it."""
        return comm if isinstance(comm, Communicator) else cls(comm)

    def check_buffer(self, array: Any, name: str) -> None:
        """Raise ValueError when this communicator cannot move ``array`` (called ``name``
        in the message). A Communicator moves host arrays and any GPU's (on the array's
        own GPU); an :class:`~sparsecoll.nccl.NCCLCommunicator` refuses a device array on
        another GPU than its own. Local: the entry points call it before their input
        agreement, which shares the error with every rank."""

    # -- progress engine ------------------------------------------------------------------
    def engine(self, call: str | None = None, *, blocking: bool = False) -> Any:
        """The progress engine of this MPI communicator, started on first use.

        Starting it is collective (every rank must reach its first nonblocking call on this
        communicator in the same order) but returns at once: the start's agreement and
        duplication are started here and completed on the engine's thread, before its
        first call. A rank making a blocking call there instead raises, as every rank's
        first request does at ``wait()``, CollectiveInputError naming both calls
        (``call``: the label of the call that starts it). ``blocking``: it starts for a
        blocking call that the watchdog watches; it is then waited for here, raising the
        start's error. Raises RuntimeError when MPI was not initialized with
        MPI_THREAD_MULTIPLE (known locally: at once).
        """
        if type(self) is not Communicator and not blocking:
            # a subclass (NCCLCommunicator) moves payloads its own way, outside the routing
            # (its blocking calls may be watched: they run in the calling thread)
            raise NotImplementedError(
                f"nonblocking calls on a {type(self).__name__} are not supported; use a "
                f"Communicator"
            )
        engine = self._attached_engine()
        if engine is None:
            error = _mpilib.thread_level_error()
            if error is not None:
                raise error
            with self.serial():  # (one start, whichever threads ask at once)
                engine = self._attached_engine()
                if engine is None:
                    engine = self._start_engine(call, blocking)
            _keyvals.stop_at_finalize()
        if blocking:
            engine.wait_started()
        return engine

    def _start_engine(self, call: str | None, blocking: bool) -> Any:
        """Start this communicator's engine: its vote (:func:`~._agree.start_vote`) and
        its duplication are started here, in order with this thread's other calls on the
        communicator, and completed on the engine's thread."""
        thread_state.starting = True  # (its calls are the start's: not watched alone)
        try:
            vote = start_vote(self, call, blocking)
            dup = _Duplicate(self, poll=True)  # (completed on the engine's thread)
        finally:
            thread_state.starting = False
        poll = bool(env_flag("SPARSECOLL_PROGRESS_POLL", True))

        def start() -> tuple[Communicator, Communicator]:
            with starting(self, call, self.timeout):  # (no engine watches it yet)
                vote.settle(dup)
                work = dup.get(poll)
                alarm = Communicator(work.mpi_comm.Dup(), poll=True)
            alarm._internal = True
            return work, alarm

        engine = Engine(self.rank, self.size, start, abort=self.abort, timeout=self.timeout)
        _keyvals.attach_engine(self.mpi_comm, engine)
        self._engine = engine
        return engine

    def _attached_engine(self) -> Any:
        # (the first step of every call on the communicator: checks that MPI still runs, and
        # that the communicator was not freed, before any MPI call on it)
        MPI = _mpilib.usable_mpi()
        engine = self._engine
        if self.mpi_comm == MPI.COMM_NULL and (engine is None or not engine.is_worker_thread()):
            # (MPI's error on a null handle aborts the job under ERRORS_ARE_FATAL)
            raise TypeError("the communicator was freed (its handle is MPI.COMM_NULL now)")
        # kept once found: the calls queued before the user frees the MPI communicator
        # (whose handle becomes MPI_COMM_NULL) still run, on the engine's duplicate; one
        # whose start failed counts as none (the next nonblocking call starts another)
        if engine is None or engine.failed:
            engine = _keyvals.attached_engine(self.mpi_comm)
            self._engine = engine = None if engine is None or engine.failed else engine
        return engine

    def serial(self) -> Any:
        """The lock (reentrant) that runs this rank's calls on the MPI communicator one at a
        time, whichever thread makes them: hold it around a sequence of calls that belong
        together (``with comm.serial(): ...``). Every communication method takes it; on the
        progress thread it is the lock of the engine's duplicate, used by that thread only.
        A thread's first take elsewhere runs :data:`~._routing.before_calls` first.
        """
        engine = self._attached_engine()
        if engine is not None and engine.is_worker_thread():
            return engine.comm._own_lock()
        return first_take(self, self._own_lock())

    def _own_lock(self) -> Any:
        """:meth:`serial`'s lock of this very Communicator's MPI communicator."""
        if self._lock is None:
            self._lock = _keyvals.serial_lock(self.mpi_comm)
        return self._lock

    def on_progress_thread(self) -> bool:
        """Whether the caller is this communicator's progress thread."""
        engine = self._attached_engine()
        return engine is not None and engine.is_worker_thread()

    @contextlib.contextmanager
    def apart(self) -> Iterator[None]:
        """Inside it, this thread's calls on this Communicator travel on a duplicate of the
        MPI communicator (made once, on first use), apart from the caller's own traffic on
        it: a receive the caller leaves pending with ``MPI.ANY_TAG`` (or a send with one of
        the algorithms' tags) cannot match an algorithm's message. Collective on first use
        (``Dup``): every rank must enter it at the same call, after the call's agreement.
        The progress engine's own duplicates are apart already."""
        if self._internal or self.on_progress_thread():
            yield
            return
        before = self._apart.comm
        self._apart.comm = _keyvals.apart(self.mpi_comm)
        try:
            yield
        finally:
            self._apart.comm = before

    def _wire(self) -> Any:
        """The MPI communicator this thread's messages travel on (see :meth:`apart`)."""
        return self._apart.comm or self.mpi_comm

    def abort(self, code: int = 1) -> None:
        """MPI_Abort: end every process of the job."""
        self.mpi_comm.Abort(code)

    def try_recv_ints(self, tag: int) -> tuple[int, list[int]] | None:
        """A small int64 message with ``tag`` from any rank, if one has arrived:
        ``(source, values)``; None otherwise (never waits)."""
        MPI = _mpilib.mpi()
        status = MPI.Status()
        msg = self._wire().Improbe(MPI.ANY_SOURCE, tag, status)
        if msg is None:
            return None
        out = np.empty(status.Get_count(MPI.BYTE) // 8, dtype=np.int64)
        msg.Recv(out)  # already matched; a few eager bytes
        return status.Get_source(), out.tolist()

    def _complete(self, name: str, *args: Any) -> Any:
        """Run MPI's blocking call ``name`` on this communicator, or in polling mode its
        nonblocking variant completed by Test calls with sleeps."""
        if self.poll:
            if name == "Sendrecv" and not _mpilib.isendrecv_works(self._wire()):
                smsg, dest, stag, rmsg, source, rtag = args
                MPI = _mpilib.mpi()
                reqs = [
                    self._wire().Irecv(rmsg, source, rtag),
                    self._wire().Isend(smsg, dest, stag),
                ]
                poll(lambda: MPI.Request.Testall(reqs))
                return None
            req = getattr(self._wire(), "I" + name[0].lower() + name[1:])(*args)
            poll(req.Test)
            return None
        return getattr(self._wire(), name)(*args)

    def measure(self) -> contextlib.AbstractContextManager[CommStats]:
        """Context manager yielding a CommStats filled with what the calling thread's calls
        made inside it moved: its blocking calls, and its requests (submitted inside it)
        that complete before it ends. Not the traffic of other threads' calls, nor of
        requests submitted before it (a blocking call waits for those to complete first;
        they are counted in ``stats`` only). Scopes nest: each counts what ran inside it.

        On the progress thread it measures the engine's duplicate.
        """
        engine = self._attached_engine()
        if engine is not None and engine.is_worker_thread():
            return engine.comm._measure()
        return self._measure()

    @property
    def cuda_aware(self) -> bool:
        """Whether device buffers go to MPI directly (else they are staged through pinned
        host memory). Detected on first use (:func:`~._mpilib.query_cuda_aware`); assignable."""
        if self._cuda_aware is None:
            self._cuda_aware = _mpilib.query_cuda_aware(self.mpi_comm)
        return self._cuda_aware

    @cuda_aware.setter
    def cuda_aware(self, value: bool) -> None:
        self._cuda_aware = bool(value)

    # -- buffers ------------------------------------------------------------------------
    # (host buffers never ask if MPI is CUDA-aware: asking costs a library lookup per call)
    def _send_view(self, buf: Any) -> Any:
        return send_view(buf, is_device_array(buf) and self.cuda_aware)

    def _recv_view(self, buf: Any) -> tuple[Any, Callable[[], None] | None]:
        return recv_view(buf, is_device_array(buf) and self.cuda_aware)

    # -- point-to-point -----------------------------------------------------------------
    @routed
    def send(self, buf: Any, dest: int, tag: int = 0) -> None:
        msg, dtype = message(self._send_view(buf))
        self._complete("Send", msg, dest, tag)
        free_type(dtype)
        self._count_send(buf, dest)

    @routed
    def recv(self, buf: Any, source: int, tag: int = 0) -> None:
        view, finish = self._recv_view(buf)
        msg, dtype = message(view)
        self._complete("Recv", msg, source, tag)
        free_type(dtype)
        if finish:
            finish()
        self._count_recv(buf, source)

    @routed
    def isend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        view = self._send_view(buf)
        msg, dtype = message(view)
        req = self._wire().Isend(msg, dest, tag)
        free_type(dtype)
        self._count_send(buf, dest)
        return Request(req, keep=view, poll=self.poll)

    @routed
    def irecv(self, buf: Any, source: int, tag: int = 0) -> Request:
        view, finish = self._recv_view(buf)
        msg, dtype = message(view)
        req = self._wire().Irecv(msg, source, tag)
        free_type(dtype)
        self._count_recv(buf, source)
        return Request(req, finish, poll=self.poll)

    @routed
    def sendrecv(self, sendbuf: Any, dest: int, recvbuf: Any, source: int, tag: int = 0) -> None:
        view, finish = self._recv_view(recvbuf)
        smsg, stype = message(self._send_view(sendbuf))
        rmsg, rtype = message(view)
        self._complete("Sendrecv", smsg, dest, tag, rmsg, source, tag)
        free_type(stype)
        free_type(rtype)
        if finish:
            finish()
        self._count_send(sendbuf, dest)
        self._count_recv(recvbuf, source)

    @routed
    def recv_bytes(self, source: int, tag: int = 0, xp: Any = np) -> Any:
        """Receive a message of unknown length from ``source`` as a uint8 array of module
        ``xp`` (numpy, or cupy to land it on the device)."""
        MPI = _mpilib.mpi()
        status = MPI.Status()
        if self.poll:
            msg = poll(lambda: self._wire().Improbe(source, tag, status))
        else:
            msg = self._wire().Mprobe(source, tag, status)
        # Get_elements: Get_count's int cannot express a count past COUNT_MAX (MPI_UNDEFINED
        # on a library without large counts); mpi4py's Get_elements takes MPI_Get_elements_x
        buf = xp.empty(status.Get_elements(MPI.BYTE), dtype=np.uint8)
        view, finish = self._recv_view(buf)
        rmsg, dtype = message(view)
        if self.poll:
            req = msg.Irecv(rmsg)
            free_type(dtype)
            poll(req.Test)
        else:
            msg.Recv(rmsg)
            free_type(dtype)
        if finish:
            finish()
        self._count_recv(buf, source)
        return buf

    # -- payload collectives ------------------------------------------------------------
    @routed
    def allgatherv(
        self, sendbuf: Any, counts: Sequence[int] | None = None
    ) -> tuple[Any, list[int]]:
        """Gather every rank's 1-D ``sendbuf`` (concatenated in rank order) on every rank.

        ``counts`` (elements per rank) may be given when every rank already knows them;
        otherwise they are exchanged first as metadata. Returns ``(recvbuf, counts)``.
        """
        if counts is None:
            counts = self.allgather_ints(int(sendbuf.shape[0]))
        counts = [int(c) for c in counts]
        total = sum(counts)
        out = get_array_module(sendbuf).empty(total, dtype=sendbuf.dtype)
        item = sendbuf.dtype.itemsize
        if self.size == 1:
            out[...] = sendbuf
            return out, counts
        rview, finish = self._recv_view(out)
        bcounts = [c * item for c in counts]
        displs = offsets(bcounts)
        MPI = _mpilib.mpi()
        if max(displs[-1], *bcounts) > _mpilib.COUNT_MAX and not _mpilib.large_counts():
            allgatherv_by_bcast(self, self._send_view(sendbuf), rview, bcounts, displs)
        else:
            self._complete(
                "Allgatherv",
                [self._send_view(sendbuf), MPI.BYTE],
                [rview, (bcounts, displs), MPI.BYTE],
            )
        if finish:
            finish()
        self._count_allgatherv((total - counts[self.rank]) * item)
        return out, counts

    @routed
    def alltoallv(self, sendbuf: Any, sendcounts: Sequence[int]) -> tuple[Any, list[int]]:
        """Send ``sendcounts[j]`` consecutive elements of ``sendbuf`` to rank j.

        Receive counts are exchanged first as metadata. Returns ``(recvbuf, recvcounts)``.
        ``sendcounts``: one integer >= 0 per rank, adding up to at most ``sendbuf.size``;
        otherwise (on any rank) every rank raises CollectiveInputError (CollectiveTypeError
        for counts that are not integers) naming that rank.
        """
        sendcounts, recvcounts = self._alltoallv_counts(sendbuf, sendcounts)
        out = get_array_module(sendbuf).empty(sum(recvcounts), dtype=sendbuf.dtype)
        item = sendbuf.dtype.itemsize
        sb = [c * item for c in sendcounts]
        rb = [c * item for c in recvcounts]
        sd, rd = offsets(sb), offsets(rb)
        rview, finish = self._recv_view(out)
        MPI = _mpilib.mpi()
        if alltoallv_past_limit(self, sb, sd, rb, rd):
            alltoallv_by_pairs(self, self._send_view(sendbuf), rview, sb, sd, rb, rd)
        else:
            self._complete(
                "Alltoallv",
                [self._send_view(sendbuf), (sb, sd), MPI.BYTE],
                [rview, (rb, rd), MPI.BYTE],
            )
        if finish:
            finish()
        self._count_alltoallv(sb, rb)
        return out, recvcounts

    def _alltoallv_counts(self, sendbuf: Any, sendcounts: Any) -> tuple[list[int], list[int]]:
        """alltoallv's ``(sendcounts, recvcounts)``: this rank's checked (and its
        ``sendbuf``, :meth:`check_buffer`), then exchanged; a rank's error goes in the
        exchange as its -1s and is raised on every rank (:func:`~._agree.share_error`):
        counts must be integers >= 0, one per rank, within ``sendbuf``."""
        error, counts = None, []
        try:
            self.check_buffer(sendbuf, "sendbuf")
            counts = [operator.index(c) for c in sendcounts]
            if len(counts) != self.size:
                raise ValueError(
                    f"sendcounts must have one count per rank ({self.size}), got {len(counts)}"
                )
            if counts and min(counts) < 0:
                raise ValueError(f"sendcounts must be >= 0, got {counts}")
            if sum(counts) > int(sendbuf.size):
                raise ValueError(
                    f"sendcounts add up to {sum(counts)} elements but sendbuf has "
                    f"{int(sendbuf.size)}"
                )
        except Exception as exc:  # (shared with every rank: none is left waiting)
            error = exc
        recvcounts = self.alltoall_ints([-1] * self.size if error else counts)
        share_error(self, recvcounts, error, f"{type(self).__name__}.alltoallv")
        return counts, recvcounts

    def allreduce(
        self, buf: Any, out: Any = None, op: str = "sum", *, check: bool = True, work: Any = None
    ) -> Any:
        """Sum a dense float array over all ranks (MPI_Allreduce) into ``out`` (default: a
        new array) and return it; ``op="mean"`` divides the sum by the number of ranks, in
        the precision it was summed in (float32 for float16: an average that fits in float16
        comes back even when the sum would overflow it).

        ``out`` (contiguous, ``buf``'s shape and dtype) may be ``buf`` itself (or another
        view of the same memory): the sum then overwrites it in place (MPI_IN_PLACE), with
        no copy of the input; an ``out`` that overlaps ``buf`` otherwise gets the sum of a
        copy of ``buf``. float16 is summed in float32 (MPI has no portable half type); the
        bytes counted are the float32 bytes actually moved. ``buf`` may be anything
        :func:`sparsecoll.allreduce` takes as values (a torch tensor comes back as one).

        With ``check`` (the default) the ranks first agree on the arguments (one small
        allreduce): a bad ``buf`` or ``out`` on any rank, or a dtype, size or op that differs
        across ranks, raises the same CollectiveInputError/CollectiveTypeError on every
        rank (MPI would sum the raw bytes of float32 against float64, or hang). Callers
        that agreed on them already pass ``check=False``.

        What the call allocates (a new ``out``, float16's float32 copy) is made before that
        agreement: memory running out on one rank is then the same CollectiveRuntimeError
        on every rank. ``work`` (float16 ``buf`` only): a contiguous float32 array of
        ``buf``'s shape to sum in instead of a new one, e.g. made by a ``check=False``
        caller before its own agreement (:func:`widening_buffer`); the result is the same.

        With the watchdog on (:func:`sparsecoll.set_timeout`), the communicator's progress
        engine watches the call, as :func:`sparsecoll.allreduce` (inside a watched call, or
        on the progress thread, it is part of that call).
        """
        # (outside the routing: on the progress thread the call runs on the engine's
        # duplicate, which has no engine to watch it; its own call is watched already)
        with self.serial(), watch(self, f"Communicator.allreduce(op={op!r})"):
            return self._allreduce(buf, out, op, check, work)

    @routed
    def _allreduce(self, buf: Any, out: Any, op: str, check: bool, work: Any) -> Any:
        given = out
        work, dest, out, wrap, orig = self._allreduce_args(buf, out, op, check, work)
        with device_scope(work):  # (a torch tensor: its CuPy view, on the tensor's GPU)
            self._allreduce_into(work, dest, op)
            total = in_dtype(dest, orig, out)
            wait_for_foreign(given, out)  # (the mean's division, float16's cast)
        return given if given is not None else wrap(total)

    def _allreduce_into(self, work: Any, dest: Any, op: str) -> None:
        """:meth:`allreduce` on the arrays :meth:`_allreduce_args` made: the sum (or mean)
        of ``work`` in ``dest`` (``work`` itself: in place)."""
        inplace = dest is work
        if self.size > 1:
            rview, finish = self._recv_view(dest)
            sview = None if inplace else self._send_view(work)
            if inplace and finish and rview.shape[0]:  # staged through the host: stage the input
                dest.reshape(-1).view(np.uint8).get(out=rview)
            self._allreduce_sum(sview, rview, int(work.size), work.dtype)
            if finish:
                finish()
            self._count_allreduce(work.nbytes)
        elif not inplace:
            dest[...] = work
        if op == "mean" and self.size > 1:
            dest /= self.size

    def _allreduce_sum(self, send: Any, recv: Any, count: int, dtype: Any) -> None:
        """MPI_Allreduce (sum) of ``count`` elements of ``dtype`` from the byte view ``send``
        (None: in place) into the byte view ``recv``. Past COUNT_MAX elements, on a
        library without large counts, in consecutive chunks of at most COUNT_MAX elements
        (the same chunks on every rank: the count is agreed), each summed as its own call."""
        MPI = _mpilib.mpi()
        mpitype = {np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE}[dtype]
        limit = _mpilib.COUNT_MAX
        step = limit if count > limit and not _mpilib.large_counts() else max(count, 1)
        item = dtype.itemsize
        for lo in range(0, max(count, 1), step):
            n = min(step, count - lo)
            part = slice(lo * item, (lo + n) * item)
            src = MPI.IN_PLACE if send is None else [send[part], n, mpitype]
            self._complete("Allreduce", src, [recv[part], n, mpitype], MPI.SUM)

    def _allreduce_args(
        self, buf: Any, out: Any, op: str, check: bool, work: Any = None
    ) -> tuple[Any, ...]:
        """``allreduce``'s arguments as arrays, and what it sums in (:func:`~._buffers.sum_buffers`,
        made before the ranks agree): ``(send, dest, out, wrap, buf's dtype)``, agreed
        across ranks when ``check``."""
        names = ("buf dtype", "buf size", "op")
        with agreement(self, names, check=check) as agree:
            buf, wrap = as_array(buf, "buf")
            if out is not None:
                out, _ = as_array(out, "out", writable=True)
            orig = buf.dtype
            buf = check_out(buf, out, op)
            self.check_buffer(buf, "buf")
            if out is not None:
                self.check_buffer(out, "out")
            if work is not None:
                work, _ = as_array(work, "work", writable=True)
            send, dest, out = sum_buffers(buf, out, work)
            agree.signature = [VALUE_DTYPES.index(orig), int(buf.size), ("sum", "mean").index(op)]
        return send, dest, out, wrap, orig

    # -- metadata (small, host) -----------------------------------------------------------
    @routed
    def allreduce_ints(self, values: Sequence[int] | np.ndarray, op: str = "sum") -> np.ndarray:
        """Reduce a small int64 vector over all ranks with ``op`` in sum/max/min."""
        return self._allreduce_meta(values, np.int64, op)

    @routed
    def iallreduce_ints(
        self, values: Sequence[int], op: str = "sum", poll: bool | None = None
    ) -> tuple[Request, Any]:
        """Start reducing a small int64 vector over all ranks (MPI_Iallreduce, ``op`` in
        sum/max/min): ``(request, out)``, ``out`` holding the result once the request has
        completed (by polling if ``poll``; None: as this communicator's calls). What every
        input agreement makes (:class:`~._agree.Vote`)."""
        MPI = _mpilib.mpi()
        a = np.ascontiguousarray(values, dtype=np.int64)
        out = np.empty_like(a)
        op_ = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]
        req = self._wire().Iallreduce(a, out, op_)
        self._meta(2 * a.nbytes, 2 * self._log2())
        return Request(req, keep=a, poll=self.poll if poll is None else poll), out

    def duplicate(self) -> _Duplicate:
        """Start duplicating the MPI communicator (``MPI_Comm_idup``: collective, in order
        with this thread's calls on it); ``.get()`` completes it."""
        return _Duplicate(self)

    @routed
    def allreduce_floats(self, values: Sequence[float] | np.ndarray, op: str = "sum") -> np.ndarray:
        """Reduce a small float64 vector over all ranks with ``op`` in sum/max/min."""
        return self._allreduce_meta(values, np.float64, op)

    def _allreduce_meta(self, values: Any, dtype: Any, op: str) -> np.ndarray:
        MPI = _mpilib.mpi()
        a = np.ascontiguousarray(values, dtype=dtype)
        out = np.empty_like(a)
        self._complete("Allreduce", a, out, {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op])
        self._meta(2 * a.nbytes, 2 * self._log2())
        return out

    @routed
    def allgather_ints(self, value: int | Sequence[int]) -> Any:
        """Gather one int (or a fixed-length int vector) from every rank: list or (P, m) array."""
        if type(value) is int:  # (the common case, without numpy's generic conversions)
            scalar, a = True, np.array((value,), dtype=np.int64)
        else:
            scalar = np.ndim(value) == 0
            a = np.ascontiguousarray(np.atleast_1d(np.asarray(value, dtype=np.int64)))
        out = np.empty((self.size, a.shape[0]), dtype=np.int64)
        self._complete("Allgather", a, out)
        self._meta(a.nbytes * (self.size - 1), self._log2())
        return out[:, 0].tolist() if scalar else out

    @routed
    def alltoall_ints(self, values: Sequence[int]) -> list[int]:
        """Send ``values[j]`` to rank j; return what every rank sent to this one."""
        a = np.ascontiguousarray(values, dtype=np.int64)
        out = np.empty_like(a)
        self._complete("Alltoall", a, out)
        self._meta(a.nbytes * (self.size - 1) // max(self.size, 1), self.size - 1)
        return out.tolist()

    @routed
    def sendrecv_ints(self, values: int | Sequence[int], dest: int, source: int, tag: int = 0):
        """Send a few ints to ``dest`` while receiving as many from ``source`` (metadata:
        e.g. the size of the payload that follows, so no probe is needed)."""
        scalar = np.ndim(values) == 0
        a = np.atleast_1d(np.asarray(values, dtype=np.int64))
        out = np.empty_like(a)
        self._complete("Sendrecv", a, dest, tag, out, source, tag)
        if dest != self.rank:
            self._meta(a.nbytes, 1)
        return int(out[0]) if scalar else out.tolist()

    @routed
    def bcast_object(self, obj: Any, root: int) -> Any:
        """Broadcast a small picklable object (error reports, configuration)."""
        if not self.poll:
            return self._wire().bcast(obj, root=root)
        data = pickle.dumps(obj) if self.rank == root else b""
        size = np.array([len(data)], dtype=np.int64)
        self._complete("Bcast", size, root)
        buf = np.frombuffer(data, np.uint8).copy() if self.rank == root else None
        buf = buf if buf is not None else np.empty(int(size[0]), dtype=np.uint8)
        self._complete("Bcast", buf, root)
        return pickle.loads(buf.tobytes())

    @routed
    def allgather_object(self, obj: Any) -> list[Any]:
        """Gather a small picklable object from every rank."""
        if not self.poll:
            return self._wire().allgather(obj)
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        sizes = np.empty(self.size, dtype=np.int64)
        self._complete("Allgather", np.array([data.shape[0]], dtype=np.int64), sizes)
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        displs = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        MPI = _mpilib.mpi()
        self._complete("Allgatherv", [data, MPI.BYTE], [out, (sizes, displs), MPI.BYTE])
        return [pickle.loads(out[d : d + c].tobytes()) for d, c in zip(displs, sizes)]

    @routed
    def barrier(self) -> None:
        self._complete("Barrier")

    @staticmethod
    def wtime() -> float:
        return float(_mpilib.mpi().Wtime())
