"""The buffers a Communicator hands to MPI: byte views, device staging, allreduce's arrays.

Host arrays go as contiguous byte views. Device (CuPy) arrays go as they are to a
CUDA-aware MPI, after the current stream is synchronized, and through pinned host memory
otherwise (the copy back to the device runs once MPI is done). A point-to-point payload past
:data:`~sparsecoll._mpilib.COUNT_MAX` bytes, on a library without large counts, travels as
one element of a derived datatype. allreduce's arguments are checked and its arrays made
(float16 widened to float32) before the ranks agree, so that an allocation failing on one
rank is that rank's input error.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _mpilib
from ._array import (
    cupy_or_none,
    device_scope,
    get_array_module,
    is_device_array,
    pinned_empty,
    synchronize,
)
from .sparse import VALUE_DTYPES

__all__ = [
    "buffers_device",
    "check_out",
    "free_type",
    "in_dtype",
    "message",
    "offsets",
    "recv_view",
    "send_view",
    "sum_buffers",
    "widening_buffer",
]


def send_view(buf: Any, cuda_aware: bool) -> Any:
    """A contiguous byte view of ``buf`` that MPI may read: device data as it is to a
    CUDA-aware MPI (after the current stream is synchronized), else copied into pinned host
    memory (a blocking copy ordered after the kernels that wrote it)."""
    if is_device_array(buf):
        with device_scope(buf):  # buf's GPU and its stream, whichever device is current
            buf = get_array_module(buf).ascontiguousarray(buf).reshape(-1).view(np.uint8)
            if cuda_aware:
                synchronize()
                return buf
            host = pinned_empty(buf.shape[0])
            if host.shape[0]:
                buf.get(out=host)
            return host
    return np.ascontiguousarray(buf).reshape(-1).view(np.uint8)


def recv_view(buf: Any, cuda_aware: bool) -> tuple[Any, Callable[[], None] | None]:
    """A byte view MPI may write into ``buf``, and the step that completes it (copying
    staged bytes to the device) to run once MPI is done; None when there is none."""
    if not buf.flags.c_contiguous:
        raise ValueError("receive buffers must be contiguous")
    flat = buf.reshape(-1).view(np.uint8)
    if not is_device_array(buf):
        return flat, None
    if cuda_aware:
        with device_scope(buf):
            synchronize()  # no queued kernel may still use the memory MPI writes
        return flat, None
    host = pinned_empty(flat.shape[0])

    def finish() -> None:
        # on buf's GPU and its stream, whichever thread completes the request
        if host.shape[0]:
            with device_scope(flat):
                stream = cupy_or_none().cuda.get_current_stream()
                flat.set(host, stream=stream)
                stream.synchronize()  # the pinned buffer is released after this

    return host, finish


def message(view: Any) -> tuple[Any, Any]:
    """The buffer argument of a point-to-point call on the byte view ``view``, and the
    datatype to free once the call has started (None when there is none).

    Past COUNT_MAX bytes, on a library without large counts, the view goes as one element
    of a type of ``q`` blocks of COUNT_MAX bytes and the rest: a sequence of bytes still,
    so a receive of plain bytes matches it, and MPI lets a type be freed while in use."""
    nbytes = int(view.shape[0])
    if nbytes <= _mpilib.COUNT_MAX or _mpilib.large_counts():
        return view, None
    MPI = _mpilib.mpi()
    q, r = divmod(nbytes, _mpilib.COUNT_MAX)
    block = MPI.BYTE.Create_contiguous(_mpilib.COUNT_MAX)
    whole = MPI.Datatype.Create_struct([q, r], [0, q * _mpilib.COUNT_MAX], [block, MPI.BYTE])
    block.Free()
    return [view, 1, whole.Commit()], whole


def free_type(dtype: Any) -> None:
    """Free a datatype that :func:`message` made (None: nothing to free)."""
    if dtype is not None:
        dtype.Free()


def offsets(counts: list[int]) -> list[int]:
    """Where each of ``counts`` consecutive parts starts: the displacements of a v-call."""
    return [0, *itertools.accumulate(counts[:-1])]


def buffers_device(args: tuple[Any, ...]) -> Any:
    """The device scope of a call's first CuPy array argument (a nullcontext when there is
    none): what the call allocates and the kernels it runs land on the buffers' GPU,
    whatever GPU is current in the calling thread."""
    cp = cupy_or_none()
    if cp is not None:
        for a in args:
            if isinstance(a, cp.ndarray):
                return a.device
    return contextlib.nullcontext()


def check_out(buf: Any, out: Any, op: str = "sum") -> Any:
    """Check an allreduce's arguments and return the ``buf`` to sum: ``buf`` must be float16,
    float32 or float64, and ``out`` able to take its sum (same array module, shape, dtype,
    contiguous, writeable). An ``out`` that is another view of ``buf``'s memory makes the
    call in place (``out`` comes back); one that partly overlaps it gets the sum of a copy
    (MPI and NCCL forbid aliased buffers)."""
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


def in_dtype(total: Any, orig: Any, out: Any) -> Any:
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


def sum_buffers(buf: Any, out: Any, work: Any) -> tuple[Any, Any, Any]:
    """The arrays an allreduce of the checked ``buf`` (:func:`check_out`) works with:
    ``(send, dest, out)``, the sum of ``send`` landing in ``dest`` (``send`` itself: in
    place) and the result in ``out`` (made here when None). float16 is copied into the
    float32 ``work`` (made here when None) and summed there in place, then rounded into
    ``out`` once. Everything allocated is made here, before the ranks agree."""
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
