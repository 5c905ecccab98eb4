"""Framework adapters; each imports its framework lazily (``sparsecoll.integrations.torch``)."""

from __future__ import annotations

__all__: list[str] = []
