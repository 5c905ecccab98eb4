"""Inside mpiexec: a rank whose tests failed aborts the job, so the others cannot hang."""

from __future__ import annotations

import pytest
from mpi4py import MPI


@pytest.fixture(scope="session")
def comm():
    from sparsecoll import Communicator

    return Communicator(MPI.COMM_WORLD)


def pytest_sessionfinish(session, exitstatus):
    if exitstatus not in (0, 5) and MPI.COMM_WORLD.Get_size() > 1:
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(int(exitstatus) or 1)
