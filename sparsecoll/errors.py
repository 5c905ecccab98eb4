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
    """Local work before a call's first collective failed on some rank; raised on every rank.

    An error not about the input (a bug, an exhausted resource, a user hook's exception),
    named with its rank instead of leaving the other ranks waiting. On the failing rank the
    original error is the ``__cause__``.
    """


class NonFiniteError(CollectiveInputError):
    """A gradient step met NaN or Inf in ``grad + residual`` on some rank; raised on every rank.

    Nothing is changed (GradientReducer.step).
    """
