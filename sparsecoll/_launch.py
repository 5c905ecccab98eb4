"""Finding mpiexec and relaunching a command under it."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = [
    "find_mpiexec",
    "launcher_mismatch",
    "mpiexec_command",
    "torch_launcher_mismatch",
    "under_mpi",
]

_MPI_ENV = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


def under_mpi() -> bool:
    """True when this process was started by an MPI launcher."""
    return any(v in os.environ for v in _MPI_ENV)


def launcher_mismatch(world_size: int, library: str) -> str | None:
    """Return why the launcher cannot be this MPI's, or None, from the environment.

    A launcher of another MPI starts P processes that each run as a world of one: P copies
    of the job. Only that is a mismatch (a world of several ranks has its launcher). The
    counts read: ``PMI_SIZE`` (Hydra, srun's PMI plugins), ``OMPI_COMM_WORLD_SIZE`` (Open
    MPI), ``MV2_COMM_WORLD_SIZE`` (MVAPICH), and srun's ``SLURM_STEP_NUM_TASKS`` when this
    process is itself a task of the step (``SLURM_TASK_PID`` is its pid; a process a task's
    shell starts may be meant to run alone).

    Args:
        world_size: the size of this MPI's COMM_WORLD.
        library: its version line, for the message.
    """
    if world_size != 1:  # a variable inherited from an outer launch may disagree
        return None
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        started = os.environ.get(var, "")
        if started.isdigit() and int(started) > 1:
            return (
                f"the launcher started {started} processes ({var}={started}) but MPI "
                f"({library}) sees {world_size} rank(s) in each: that mpiexec is another MPI's "
                "than mpi4py's; use the mpiexec of mpi4py's MPI (SPARSECOLL_MPIEXEC) or "
                f"build mpi4py against the launcher's MPI (a process meant to run alone, "
                f"started by a rank of another job: unset {var})"
            )
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "")
    if (
        tasks.isdigit()
        and int(tasks) > 1
        and os.environ.get("SLURM_TASK_PID", "").strip() == str(os.getpid())
    ):
        return (
            f"srun started {tasks} tasks (SLURM_STEP_NUM_TASKS={tasks}) but MPI ({library}) "
            f"sees {world_size} rank(s) in each: srun did not start them as one job of "
            "mpi4py's MPI; give srun the --mpi= plugin (PMI) that this MPI was built for "
            "(srun --mpi=list shows srun's), or launch with that MPI's mpiexec "
            "(SPARSECOLL_MPIEXEC) (a task meant to run alone: unset SLURM_STEP_NUM_TASKS)"
        )
    return None


def torch_launcher_mismatch(world_size: int, world_rank: int) -> str | None:
    """Return why a torch launcher's environment disagrees with COMM_WORLD, or None.

    torchrun starts no MPI job, so each process it starts is an MPI world of one. A
    mismatch: ``WORLD_SIZE`` or ``RANK`` unlike COMM_WORLD's, or ``LOCAL_WORLD_SIZE`` /
    ``LOCAL_RANK`` counting more processes than it holds (non-integers are left alone).
    """
    wrong = []
    for var, want, local in (
        ("WORLD_SIZE", world_size, False),
        ("RANK", world_rank, False),
        ("LOCAL_WORLD_SIZE", world_size, True),
        ("LOCAL_RANK", world_size - 1, True),
    ):
        value = os.environ.get(var, "").strip()
        if value.isdigit() and (int(value) > want if local else int(value) != want):
            wrong.append(f"{var}={value}")
    if not wrong:
        return None
    return (
        f"the environment says {', '.join(wrong)} (a torch launcher's: torchrun?) but MPI's "
        f"COMM_WORLD has {world_size} rank(s), this one rank {world_rank}: the processes "
        f"were not started as one MPI job (under torchrun each is an MPI world of one, and "
        f"torch's rendezvous would wait for ranks that never come); launch with "
        f"`mpiexec -n N python script.py`, not torchrun"
    )


def find_mpiexec() -> str:
    """Return mpiexec: $SPARSECOLL_MPIEXEC, else beside the interpreter (mpich wheel), PATH."""
    env = os.environ.get("SPARSECOLL_MPIEXEC")
    if env:
        found = shutil.which(env)  # a path, or a command's name to look up on PATH
        if not found:
            raise RuntimeError(f"SPARSECOLL_MPIEXEC={env!r} is not an executable file")
        return found
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


def mpiexec_command(nprocs: int, mpiexec: str | None = None) -> list[str]:
    """Return ``mpiexec -n P``, ready for the program's command line, on any launcher.

    Open MPI's gets ``--oversubscribe``: it refuses more ranks than the host has cores,
    where MPICH's starts them.
    """
    exe = mpiexec or find_mpiexec()
    extra = ["--oversubscribe"] if _is_open_mpi(exe) else []
    return [exe, *extra, "-n", str(nprocs)]


@functools.cache
def _is_open_mpi(mpiexec: str) -> bool:
    """Return whether ``mpiexec --version`` names Open MPI ("Open MPI", or "OpenRTE" <= 4)."""
    try:
        proc = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return False
    text = proc.stdout + proc.stderr
    return "Open MPI" in text or "OpenRTE" in text
