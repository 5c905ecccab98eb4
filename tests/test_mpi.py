"""Run every file of tests/mpi/ under mpiexec with P = 1, 2, 3, 4, 5 and 8 ranks.

While developing, ``SPARSECOLL_NPROCS=4 pytest`` (or ``=2,3``) runs them at those P only;
CI (``CI`` set) always runs every P.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import pytest

from .mpirun import run_mpi

MPI_FILES = sorted((Path(__file__).parent / "mpi").glob("test_*.py"))
NPROCS = [1, 2, 3, 4, 5, 8]


def select_nprocs(env: Mapping[str, str]) -> list[int]:
    """The P values to run: every one, or those SPARSECOLL_NPROCS lists (ignored in CI)."""
    text = env.get("SPARSECOLL_NPROCS", "").strip()
    if not text or env.get("CI"):
        return NPROCS
    try:
        chosen = [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"SPARSECOLL_NPROCS: expecting P or P,P,..., got {text!r}") from None
    if any(p < 1 for p in chosen):
        raise ValueError(f"SPARSECOLL_NPROCS: expecting P >= 1, got {text!r}")
    return chosen


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", select_nprocs(os.environ))
@pytest.mark.parametrize("path", MPI_FILES, ids=lambda p: p.stem)
def test_under_mpiexec(path: Path, nprocs: int) -> None:
    proc = run_mpi(nprocs, ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(path)])
    assert proc.returncode == 0, f"mpiexec -n {nprocs} {path.name} failed:\n{proc.stdout[-8000:]}"


def test_nprocs_knob() -> None:
    assert select_nprocs({}) == NPROCS
    assert select_nprocs({"SPARSECOLL_NPROCS": "4"}) == [4]
    assert select_nprocs({"SPARSECOLL_NPROCS": "2,3"}) == [2, 3]
    assert select_nprocs({"SPARSECOLL_NPROCS": "4", "CI": "true"}) == NPROCS
    for bad in ("x", "0", "2,,3"):
        with pytest.raises(ValueError, match="SPARSECOLL_NPROCS"):
            select_nprocs({"SPARSECOLL_NPROCS": bad})


def test_readme_says_how_to_run_a_quick_subset() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert 'pytest -m "not mpi"' in readme
    assert "SPARSECOLL_NPROCS=4 pytest" in readme
