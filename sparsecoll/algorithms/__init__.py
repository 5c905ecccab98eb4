"""Built-in algorithms, one module each; the registry imports one on its first lookup.

Each module registers its class with :func:`sparsecoll.registry.register_algorithm` and is
named in :data:`sparsecoll.registry.BUILTINS`.
"""

from __future__ import annotations

from .base import Algorithm

__all__ = ["Algorithm"]
