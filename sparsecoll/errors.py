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

    Not an input error (a bug, an exhausted resource, a hook's exception); on the failing rank
    the original error is the ``__cause__``.
    """


class NonFiniteError(CollectiveInputError):
    """A gradient step met NaN or Inf on some rank; raised on every rank, nothing changed."""
