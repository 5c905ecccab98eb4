"""Numba plumbing shared by the CPU kernels: thread count, serial/parallel twins, chunking.

Every kernel is compiled twice: a serial version and a parallel one. Arrays under
``PARALLEL_MIN`` keys, and every array when only one thread is available, run the serial
version, which never touches Numba's thread pool: waking the pool costs more than the job
there, and an idle OpenMP pool spins on the cores that other MPI ranks on the node need.
The thread count (:func:`get_num_threads`) is the cores this process may run on divided by
the MPI ranks on its node (from the launcher's environment: MPICH/Hydra, Open MPI, MVAPICH,
Slurm, PALS), at least 1; ``SPARSECOLL_NUM_THREADS``, ``NUMBA_NUM_THREADS`` or
:func:`set_num_threads` override it. Kernels see the unsigned-integer view of x (its keys,
``_common``).
"""

from __future__ import annotations

import os
import types
from typing import Any

import numba
import numpy as np
from numba import njit

try:  # LLVM's cttz: the position of the lowest set bit (the bit width for 0)
    from numba.cpython.unsafe.numbers import trailing_zeros as _ctz
except ImportError:  # pragma: no cover - older or newer Numba without it

    @njit(inline="always")
    def _ctz(x):
        if x == 0:
            return 64  # as cttz with zero defined
        j = 0
        while not (x >> j) & 1:
            j += 1
        return j


from .._jit import cached_njit
from .._options import env_integer
from ._common import key_info

__all__ = ["get_num_threads", "set_num_threads"]

MIN_CHUNK = 1 << 16  # elements per parallel chunk, at least (tests lower it)
CHUNKS_PER_THREAD = 4  # count/scatter chunks per thread (evens out a shared machine)
PARALLEL_MIN = 1 << 22  # smaller arrays run on one thread (a parallel launch costs more)


# -- threads ------------------------------------------------------------------------------
# Environment variables through which launchers tell a process how many ranks share its node.
LOCAL_SIZE_VARS = (
    "MPI_LOCALNRANKS",  # MPICH / Hydra
    "OMPI_COMM_WORLD_LOCAL_SIZE",  # Open MPI
    "MV2_COMM_WORLD_LOCAL_SIZE",  # MVAPICH
    "PALS_LOCAL_SIZE",  # HPE Cray PALS
    "SLURM_NTASKS_PER_NODE",  # Slurm (when set)
)
_threads: int | None = None  # chosen on first use, or by set_num_threads


def _local_ranks() -> int:
    for var in LOCAL_SIZE_VARS:
        text = os.environ.get(var, "").split("(")[0].split(",")[0]  # Slurm: "4(x2),3"
        if text.strip().isdigit() and int(text) > 0:
            return int(text)
    return 1


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def get_num_threads() -> int:
    """Threads the selection kernels use: cores available / MPI ranks on this node (>= 1),
    unless set by ``SPARSECOLL_NUM_THREADS``, ``NUMBA_NUM_THREADS`` or
    :func:`set_num_threads`; never more than Numba's pool."""
    global _threads
    if _threads is None:
        pool = numba.config.NUMBA_NUM_THREADS
        want = env_integer("SPARSECOLL_NUM_THREADS", 1)  # (x or -1: an error, not dropped)
        if want is None:
            want = pool if "NUMBA_NUM_THREADS" in os.environ else _cores() // _local_ranks()
        _threads = min(pool, max(1, want))
    return _threads


def set_num_threads(n: int) -> None:
    """Use n threads (1 <= n <= Numba's ``NUMBA_NUM_THREADS``) in the selection kernels."""
    global _threads
    pool = numba.config.NUMBA_NUM_THREADS
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"threads must be an integer in [1, {pool}], got {type(n).__name__}")
    if not 1 <= n <= pool:
        raise ValueError(f"threads must be an integer in [1, {pool}], got {n!r}")
    _threads = int(n)


class _Kernel:
    """A kernel compiled twice: ``serial`` (prange runs as range) and ``parallel``."""

    __slots__ = ("parallel", "serial")

    def __init__(self, fn: Any, **flags: Any) -> None:
        self.parallel = cached_njit(parallel=True, nogil=True, **flags)(fn)
        # A separate function object (its own name, so its own cache file: Numba's cache
        # is keyed by name and signature, not by the parallel flag).
        twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial")
        twin.__qualname__ = fn.__qualname__ + "_serial"
        twin.__module__ = fn.__module__
        self.serial = cached_njit(nogil=True, **flags)(twin)


def _kernels(**flags: Any) -> Any:
    return lambda fn: _Kernel(fn, **flags)


# -- drivers ------------------------------------------------------------------------------


def _parallel(n: int) -> bool:
    return n >= PARALLEL_MIN and get_num_threads() > 1


def _bounds(n: int, per_thread: int) -> np.ndarray:
    threads = get_num_threads() if _parallel(n) else 1
    parts = max(1, min(-(-n // MIN_CHUNK), per_thread * threads))
    return (np.arange(parts + 1, dtype=np.int64) * n) // parts


def _run(kernel: _Kernel, m: int, *args: Any) -> None:
    """Call a kernel over m keys: the serial version when m is small or one thread is all
    there is; else the parallel one on get_num_threads() threads, handed chunks one at a time
    (a thread that the OS parks on a shared machine then holds up less)."""
    if not _parallel(m):
        kernel.serial(*args)
        return
    threads = get_num_threads()
    if numba.get_num_threads() != threads:  # Numba's setting is per calling thread
        numba.set_num_threads(threads)
    with numba.parallel_chunksize(1):
        kernel.parallel(*args)


def _keys(x: np.ndarray) -> tuple[np.ndarray, Any]:
    info = key_info(x.dtype)
    return x.view(info.utype), info


def _u(info: Any, v: int) -> Any:
    return info.utype.type(v)
