"""PyTorch DistributedDataParallel: a communication hook that reduces each gradient bucket with
a :class:`sparsecoll.GradientReducer` over MPI, and a gloo process group from MPI.

Three lines in a training script (after the model is built)::

    from sparsecoll.integrations import torch as sc_torch
    sc_torch.init_process_group()                       # gloo, rank/size from MPI
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(sc_torch.SparseHookState(density=0.01),  # oktopk by default
                           sc_torch.sparse_allreduce_hook)

DDP needs a torch process group even when the hook does all the gradient traffic (it
broadcasts the initial parameters through it): gloo is enough. The hook reduces densely for
``warmup`` iterations (at least one: DDP rebuilds its buckets after the first) before each
bucket gets its own reducer.

Under ``torchrun`` (no MPI), :class:`TorchCommunicator` runs every sparsecoll algorithm over
a torch process group: ``sparsecoll.allreduce(TorchCommunicator(), values, indices, n=n)``.

Importing this package also registers the ``"sparsecoll"`` torch.distributed backend
(:mod:`._backend`; it imports torch.distributed, where torch is installed):
``dist.init_process_group("sparsecoll")`` under torchrun or mpiexec, whose sparse
``all_reduce`` runs a sparsecoll exact algorithm (docs/guide/torch-backend.md).
"""

from __future__ import annotations

from ._comm import TorchCommunicator
from ._group import init_process_group
from ._hooks import async_sparse_allreduce_hook, sparse_allreduce_hook
from ._register import register_backend
from ._state import SparseHookState

register_backend()

__all__ = [
    "SparseHookState",
    "TorchCommunicator",
    "async_sparse_allreduce_hook",
    "init_process_group",
    "register_backend",
    "sparse_allreduce_hook",
]
