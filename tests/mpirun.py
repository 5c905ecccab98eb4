"""Launch a command under mpiexec from a test, with a timeout that kills every rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sparsecoll._launch import mpiexec_command

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = float(os.environ.get("SPARSECOLL_MPI_TIMEOUT", "600"))
# the tests/mpi/ files each P runs in this session (tests/conftest.py fills it after the
# selection: -k, -m, SPARSECOLL_NPROCS), which tests/test_mpi.py launches together
MPI_SELECTED = pytest.StashKey[dict]()
# tests/test_mpi.py's launches in this session, by (P, files): the summary lists their times
LAUNCHES = pytest.StashKey[dict]()


def run_mpi(nprocs: int, args: list[str], timeout: float = TIMEOUT, env: dict | None = None):
    """Run ``python ARGS`` on ``nprocs`` ranks; return the CompletedProcess (output merged).

    The whole process group is killed on timeout, so a hang fails instead of blocking.
    """
    cmd, full_env = _command(nprocs, args, env)
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(
            f"timed out after {timeout:.0f}s (a hang?): {' '.join(cmd)}\n{out[-6000:]}"
        ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def _command(nprocs: int, args: list[str], env: dict | None) -> tuple[list[str], dict]:
    cmd = [*mpiexec_command(nprocs), sys.executable, *args]
    full_env = dict(os.environ)
    full_env["SPARSECOLL_IN_MPIEXEC"] = "1"
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), full_env.get("PYTHONPATH", "")) if p
    )
    full_env.update(env or {})
    return cmd, full_env


def run_mpi_watched(
    nprocs: int, args: list[str], watch: Path, idle: float = TIMEOUT, env: dict | None = None
) -> tuple[subprocess.CompletedProcess, bool]:
    """Run ``python ARGS`` on ``nprocs`` ranks, killed (the whole process group) once
    nothing has moved for ``idle`` seconds: no new output, no file under ``watch`` written.
    Returns the CompletedProcess (output merged) and whether it was killed so."""
    cmd, full_env = _command(nprocs, args, env)
    return run_watched(cmd, full_env, watch, idle)


def run_watched(
    cmd: list[str], env: dict, watch: Path, idle: float = TIMEOUT
) -> tuple[subprocess.CompletedProcess, bool]:
    """Run ``cmd`` (a launcher's command line) in ROOT with ``env``, killed as
    :func:`run_mpi_watched` says; returns what it returns."""
    import tempfile
    import time

    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        seen, moved, killed = (-1, -1.0), time.monotonic(), False
        while proc.poll() is None:
            time.sleep(0.5)
            mtimes = [f.stat().st_mtime for f in watch.iterdir()] if watch.is_dir() else []
            now = (os.fstat(log.fileno()).st_size, max(mtimes, default=0.0))
            if now != seen:
                seen, moved = now, time.monotonic()
            elif time.monotonic() - moved > idle:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                killed = True
        log.seek(0)
        out = log.read()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None), killed
