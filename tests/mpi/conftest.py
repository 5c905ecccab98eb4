"""Inside mpiexec: a rank whose tests failed aborts the job, so the others cannot hang.

With ``SPARSECOLL_MPI_RECORD=DIR`` (set by tests/test_mpi.py, which runs several files in one
launch) each rank also writes what it collected and each test's outcome to
``DIR/rank<r>.jsonl``, a line at a time, so that the launching test can tell which file
failed, which completed, and where a launch that hung or aborted stopped; the ranks then
wait for each other at the end of every file, and record the time it ended.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from mpi4py import MPI

RECORD = os.environ.get("SPARSECOLL_MPI_RECORD")


def _record(entry: dict) -> None:
    path = os.path.join(RECORD, f"rank{MPI.COMM_WORLD.Get_rank()}.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


if RECORD:

    def pytest_collection_finish(session):
        _record({"collected": [item.nodeid for item in session.items], "t": time.time()})

    def pytest_collectreport(report):
        if report.failed:
            _record({"collect_error": report.nodeid})

    def pytest_runtest_logreport(report):
        if report.failed:
            _record({"failed": report.nodeid, "when": report.when})
        if report.when == "teardown":
            _record({"done": report.nodeid})

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        """After a file's last test (recorded), wait for every rank to finish that file: a
        rank that fails in the next file aborts the job, which killed a rank still in this
        one before it recorded its last tests."""
        yield
        if nextitem is None or nextitem.path != item.path:
            MPI.COMM_WORLD.Barrier()
            _record({"file_done": item.nodeid.split("::")[0], "t": time.time()})


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
