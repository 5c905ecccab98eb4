"""The public entry point on a single-process communicator (MPI.COMM_SELF), in-process."""

from __future__ import annotations

import numpy as np
import pytest

import sparsecoll


@pytest.fixture(scope="module")
def self_comm():
    from mpi4py import MPI

    return MPI.COMM_SELF


def test_accepts_lists_and_returns_numpy(self_comm):
    out = sparsecoll.allreduce(self_comm, np.array([1.0, 2.0, 3.0]), [4, 1, 4], n=5)
    assert out.indices.tolist() == [1, 4] and out.values.tolist() == [2.0, 4.0]
    assert out.values.dtype == np.float64
    assert np.array_equal(out.to_dense(), [0, 2, 0, 0, 4])


def test_empty_input(self_comm):
    out = sparsecoll.allreduce(self_comm, np.zeros(0, np.float32), np.zeros(0, np.int64), n=3)
    assert out.nnz == 0 and out.values.dtype == np.float32


def test_communicator_wrapper_keeps_stats(self_comm):
    c = sparsecoll.Communicator(self_comm)
    sparsecoll.allreduce(c, np.ones(3, np.float32), np.arange(3), n=3, algorithm="dense")
    assert c.last_stats.bytes_sent == 0  # one rank moves nothing


def test_rejects_non_communicator():
    with pytest.raises(TypeError, match="Intracomm"):
        sparsecoll.allreduce(object(), np.ones(1), np.zeros(1, np.int64), n=1)


def test_options_with_instance_rejected(self_comm):
    algo = sparsecoll.get_algorithm("allgather")
    with pytest.raises(sparsecoll.CollectiveTypeError, match="options go to get_algorithm"):
        sparsecoll.allreduce(self_comm, np.ones(1), np.zeros(1, np.int64), n=1, algorithm=algo, k=1)


def test_torch_cpu_tensors_round_trip(self_comm):
    torch = pytest.importorskip("torch")
    vals = torch.tensor([1.0, 2.0], dtype=torch.float32)
    idx = torch.tensor([3, 3])
    out = sparsecoll.allreduce(self_comm, vals, idx, n=4)
    assert isinstance(out.values, torch.Tensor)
    assert out.indices.tolist() == [3] and out.values.tolist() == [3.0]
