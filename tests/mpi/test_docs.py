"""The runnable ```python examples of README.md and docs/ under mpiexec, every rank running
each as a script of its own (tests/docexamples.py)."""

from __future__ import annotations

import pytest

from ..docexamples import examples

RUN = examples("run")


@pytest.mark.parametrize("example", RUN, ids=[ex.id for ex in RUN])
def test_example_runs(comm, example):
    example.run()
    comm.barrier()
