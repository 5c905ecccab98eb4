"""Registering the "sparsecoll" torch.distributed backend at import, where torch is
installed (the backend itself, :mod:`._backend`, imports torch)."""

from __future__ import annotations

import importlib.util

__all__ = ["register_backend"]


def register_backend() -> bool:
    """Make ``backend="sparsecoll"`` known to ``torch.distributed.init_process_group``;
    return whether it is (False: torch, or its distributed package, is not installed).
    Importing :mod:`sparsecoll.integrations.torch` calls it."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch.distributed as dist

    if not dist.is_available():
        return False
    from ._backend import register

    register()
    return True
