"""Inside mpiexec: a rank whose tests failed aborts the job, so the others cannot hang."""

from __future__ import annotations

import pytest
from mpi4py import MPI

_failed: list[int] = []  # the session's exit status, when it failed


@pytest.fixture(scope="session")
def comm():
    from sparsecoll import Communicator

    return Communicator(MPI.COMM_WORLD)


def pytest_sessionfinish(session, exitstatus):
    if exitstatus not in (0, 5) and MPI.COMM_WORLD.Get_size() > 1:
        _failed.append(int(exitstatus) or 1)


def pytest_unconfigure(config):
    """Abort here, not in pytest_sessionfinish: the failure report is printed after that
    hook (by the terminal reporter's wrapper of it), and MPI_Abort ends this rank at once."""
    if _failed:
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(_failed[0])
