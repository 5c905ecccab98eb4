"""Run every file of tests/mpi/ under mpiexec with P = 1, 2, 3, 4, 5 and 8 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from .mpirun import run_mpi

MPI_FILES = sorted((Path(__file__).parent / "mpi").glob("test_*.py"))
NPROCS = [1, 2, 3, 4, 5, 8]


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", NPROCS)
@pytest.mark.parametrize("path", MPI_FILES, ids=lambda p: p.stem)
def test_under_mpiexec(path: Path, nprocs: int) -> None:
    proc = run_mpi(nprocs, ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(path)])
    assert proc.returncode == 0, f"mpiexec -n {nprocs} {path.name} failed:\n{proc.stdout[-8000:]}"
