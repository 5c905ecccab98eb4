"""Launch a command under mpiexec from a test, with a timeout that kills every rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from sparsecoll._launch import mpiexec_command

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = float(os.environ.get("SPARSECOLL_MPI_TIMEOUT", "600"))


def run_mpi(nprocs: int, args: list[str], timeout: float = TIMEOUT, env: dict | None = None):
    """Run ``python ARGS`` on ``nprocs`` ranks; return the CompletedProcess (output merged).

    The whole process group is killed on timeout, so a hang fails instead of blocking.
    """
    cmd = [*mpiexec_command(nprocs), sys.executable, *args]
    full_env = dict(os.environ)
    full_env["SPARSECOLL_IN_MPIEXEC"] = "1"
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), full_env.get("PYTHONPATH", "")) if p
    )
    full_env.update(env or {})
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
