"""Exception types raised by sparsecoll."""

from __future__ import annotations

__all__ = [
    "AlgorithmExistsError",
    "CollectiveInputError",
    "CollectiveRuntimeError",
    "CollectiveTypeError",
    "NonFiniteError",
    "SparseCollError",
    "UnknownAlgorithmError",
]


class SparseCollError(Exception):
    """Base class of every error sparsecoll raises on purpose."""


class UnknownAlgorithmError(SparseCollError, ValueError):
    """An algorithm name that is not in the registry."""


class AlgorithmExistsError(SparseCollError, ValueError):
    """An algorithm name registered twice."""


class CollectiveInputError(SparseCollError, ValueError):
    """Input rejected on some rank; raised on every rank of the communicator."""


class CollectiveTypeError(SparseCollError, TypeError):
    """Input of the wrong type on some rank; raised on every rank of the communicator."""


class CollectiveRuntimeError(SparseCollError, RuntimeError):
    """A call's local work before its first collective failed on some rank with an error
    that is not about the input (a bug, an exhausted resource, a user hook's exception);
    raised on every rank, naming the rank and the original error, instead of leaving the
    other ranks waiting. On the failing rank the original error is its ``__cause__``."""


class NonFiniteError(CollectiveInputError):
    """A gradient step met NaN or Inf (in ``grad + residual``) on some rank; raised on every
    rank, with nothing changed (GradientReducer.step)."""
