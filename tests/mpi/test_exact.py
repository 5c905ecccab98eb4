"""Exact algorithms equal the dense sum of every rank's input (property-based, under MPI)."""

from __future__ import annotations

import pytest
from hypothesis import given

import sparsecoll
from sparsecoll.registry import algorithm_class

from .cases import assert_all, assert_identical, cases, local_input, mismatch

EXACT = [a for a in sparsecoll.available_algorithms() if algorithm_class(a).exact]


@pytest.mark.parametrize("name", EXACT)
@given(case=cases())
def test_equals_dense_sum(comm, name, case):
    if algorithm_class(name).densifies and case.huge:
        return
    vals, idx = local_input(case, comm.rank, comm.size)
    out = sparsecoll.allreduce(comm.mpi_comm, vals, idx, n=case.n, algorithm=name)
    why = mismatch(out, case, comm.size)
    assert_all(comm, why is None, str(why))
    assert_identical(comm, out)
    # the input arrays are not modified
    vals2, idx2 = local_input(case, comm.rank, comm.size)
    assert_all(comm, (vals2 == vals).all() and (idx2 == idx).all(), "input modified")
