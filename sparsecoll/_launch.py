"""Finding mpiexec and relaunching a command under it."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

__all__ = ["find_mpiexec", "under_mpi"]

_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


def under_mpi() -> bool:
    """True when this process was started by an MPI launcher."""
    return any(v in os.environ for v in _MPI_ENV)


def find_mpiexec() -> str:
    """mpiexec next to the running interpreter first (the ``mpich`` wheel), then on PATH."""
    env = os.environ.get("SPARSECOLL_MPIEXEC")
    if env:
        return env
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec")
    if found:
        return found
    raise RuntimeError(
        "mpiexec not found: pip install 'sparsecoll[mpi]' installs MPICH from PyPI, "
        "or put your site MPI's mpiexec on PATH (or set SPARSECOLL_MPIEXEC)"
    )
