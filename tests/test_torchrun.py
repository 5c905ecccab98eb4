"""Run the files of tests/torchrun/ under ``torchrun --standalone --nproc-per-node P`` (no MPI
launcher) at P = 1, 2, 3 and 4: one launch per file and P, each rank running
``pytest -q -x FILE``, killed when nothing has moved (no output) for
``SPARSECOLL_TORCHRUN_TIMEOUT`` seconds (default 600).

To add tests, drop a ``tests/torchrun/test_<name>.py``: it is picked up here (one test per
file and P, ``test_under_torchrun[test_<name>-P]``). Inside the launch
(``SPARSECOLL_IN_TORCHRUN=1``, ``torch.distributed``'s env:// variables set by torchrun)
tests/torchrun/conftest.py offers ``process_group``, the default process group (gloo,
made on first use with a timeout of ``SPARSECOLL_TORCHRUN_PG_TIMEOUT`` seconds, default
300, and ended after the tests), and ``comm``, a
:class:`~sparsecoll.integrations.torch.TorchCommunicator` of it; a file that needs
another default group makes its own instead (and ends it). Hypothesis is derandomized
there, as under mpiexec, so every rank draws the same examples; a check that depends on
one rank's data must be collective (``tests/mpi/cases.py``'s ``assert_all``), so that
every rank fails together rather than leaving the others waiting. A failing rank exits
nonzero and torchrun ends the others; a hang ends at the process group's timeout, or
here when nothing moves. :func:`run_torchrun` launches any other command the same way.

``SPARSECOLL_NPROCS=2,3 pytest tests/test_torchrun.py`` runs every file at those P only
(CI ignores it); ``-k test_comm-2`` picks one file at one P. The launches are marked
``mpi``, as tests/test_mpi.py's are: multi-process, left out of ``pytest -m "not mpi"``
and of the quick tier. Skipped without torch.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

from .mpirun import ROOT, run_watched
from .test_mpi import select_nprocs

TORCHRUN_FILES = sorted((Path(__file__).parent / "torchrun").glob("test_*.py"))
NPROCS = [1, 2, 3, 4]
TIMEOUT = float(os.environ.get("SPARSECOLL_TORCHRUN_TIMEOUT", "600"))


def torchrun_command(nprocs: int, args: list[str]) -> list[str]:
    """``torchrun --standalone --nproc-per-node P`` running ``python ARGS`` on each rank
    (this interpreter's torchrun)."""
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*run, "--nproc-per-node", str(nprocs), *args]


def run_torchrun(
    nprocs: int, args: list[str], idle: float = TIMEOUT, env: dict | None = None
) -> tuple[object, bool]:
    """Run ``python ARGS`` on ``nprocs`` ranks under torchrun, killed (the whole process
    group) once nothing has moved for ``idle`` seconds; returns the CompletedProcess
    (output merged) and whether it was killed so."""
    full_env = dict(os.environ)
    path = os.pathsep.join(p for p in (str(ROOT), full_env.get("PYTHONPATH", "")) if p)
    full_env.update(PYTHONPATH=path, SPARSECOLL_IN_TORCHRUN="1", OMP_NUM_THREADS="1")
    full_env.update(env or {})
    with tempfile.TemporaryDirectory(prefix="sparsecoll-torchrun-") as tmp:
        return run_watched(torchrun_command(nprocs, args), full_env, Path(tmp), idle)


def torchrun_cases(env: dict) -> list:
    chosen = select_nprocs(env) or NPROCS
    return [pytest.param(f, p, id=f"{f.stem}-{p}") for p in sorted(chosen) for f in TORCHRUN_FILES]


@pytest.mark.mpi
@pytest.mark.parametrize(("path", "nprocs"), torchrun_cases(dict(os.environ)))
def test_under_torchrun(path: Path, nprocs: int) -> None:
    pytest.importorskip("torch")
    args = ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(path)]
    proc, hung = run_torchrun(nprocs, args)
    out = proc.stdout[-8000:]
    assert not hung, f"torchrun -n {nprocs} {path.name}: nothing moved for {TIMEOUT:.0f} s\n{out}"
    assert proc.returncode == 0, f"torchrun -n {nprocs} {path.name}: exit {proc.returncode}\n{out}"


def test_cases_cover_every_file() -> None:
    cases = torchrun_cases({"CI": "true"})
    assert TORCHRUN_FILES, "no tests/torchrun/test_*.py"
    assert {(c.values[0], c.values[1]) for c in cases} == {
        (f, p) for f in TORCHRUN_FILES for p in NPROCS
    }
    assert {c.values[1] for c in torchrun_cases({"SPARSECOLL_NPROCS": "2,3"})} == {2, 3}
