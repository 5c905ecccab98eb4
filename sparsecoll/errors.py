"""Exception types raised by sparsecoll."""

from __future__ import annotations

__all__ = [
    "AlgorithmExistsError",
    "CollectiveInputError",
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


class NonFiniteError(CollectiveInputError):
    """A gradient step met NaN or Inf (in ``grad + residual``) on some rank; raised on every
    rank, with nothing changed (GradientReducer.step)."""
