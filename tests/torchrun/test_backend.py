"""The "sparsecoll" torch.distributed backend under torchrun (no MPI): a group of every rank
on it, whose sparse transport is a TorchCommunicator of itself, passes the tests that
tests/mpi/test_torch_backend.py runs under mpiexec (dense collectives, sparse all_reduce
equal to the dense sum, hybrid tensors, async, bad input on every rank, DDP with a sparse
embedding equal to gloo's). The default group is the conftest's (gloo)."""

from __future__ import annotations

import os
import sys

import pytest

if os.environ.get("SPARSECOLL_IN_TORCHRUN") != "1":  # (tests/test_torchrun.py launches it)
    pytest.skip("runs under torchrun only", allow_module_level=True)
torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from ..mpi.test_torch_backend import pytestmark as pytestmark  # noqa: E402
from ..mpi.test_torch_backend import (  # noqa: E402
    test_algorithm_by_option_and_environment,
    test_async,
    test_bad_input_raises_on_every_rank,
    test_ddp_sparse_embedding_matches_gloo,
    test_dense_and_sparse_mixed_raise_on_every_rank,
    test_dense_collectives,
    test_selecting_or_unknown_algorithm_raises_on_every_rank,
    test_sparse_all_reduce_avg,
    test_sparse_all_reduce_is_the_dense_sum,
)

__all__ = [
    "test_algorithm_by_option_and_environment",
    "test_async",
    "test_bad_input_raises_on_every_rank",
    "test_ddp_sparse_embedding_matches_gloo",
    "test_dense_and_sparse_mixed_raise_on_every_rank",
    "test_dense_collectives",
    "test_selecting_or_unknown_algorithm_raises_on_every_rank",
    "test_sparse_all_reduce_avg",
    "test_sparse_all_reduce_is_the_dense_sum",
]


@pytest.fixture(scope="module")
def group():
    """A sparsecoll group of every rank: over torch, there being no MPI job."""
    return dist.new_group(backend="sparsecoll")


def test_transport_is_torch(group, comm):
    from sparsecoll.integrations.torch import TorchCommunicator

    assert isinstance(group.comm, TorchCommunicator)
    assert "mpi4py" not in sys.modules
