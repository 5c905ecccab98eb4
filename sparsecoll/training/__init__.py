"""Training: :class:`GradientReducer`, a stateful sparse gradient allreduce with error
feedback (``reducer``), its step strategies (``_steps``) and checkpoint format
(``_checkpoint``)."""

from __future__ import annotations

from .reducer import GradientReducer

__all__ = ["GradientReducer"]
