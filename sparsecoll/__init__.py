"""sparsecoll: sparse collectives (sparse allreduce) for distributed deep learning."""

import os as _os

# Numba colours the error messages it builds while compiling with colorama, whose exit
# handler writes a terminal reset (ESC[0m) when stdout is a terminal; Open MPI 4 gives every
# rank a pseudo-terminal even when mpiexec's output goes to a file, so CSV or JSON output
# would end in a stray escape. Plain messages, unless the user chose otherwise (read when
# Numba is first imported).
_os.environ.setdefault("NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING", "1")

from ._progress import SparseRequest
from ._timeout import get_timeout, set_timeout
from .algorithms.base import Algorithm
from .api import allreduce, iallreduce
from .comm import CommStats, Communicator
from .errors import (
    AlgorithmExistsError,
    CollectiveInputError,
    CollectiveRuntimeError,
    CollectiveTypeError,
    NonFiniteError,
    SparseCollError,
    UnknownAlgorithmError,
)
from .registry import available_algorithms, get_algorithm, register_algorithm
from .sparse import SparseVector
from .training import GradientReducer

__version__ = "0.1.0"

__all__ = [
    "Algorithm",
    "AlgorithmExistsError",
    "CollectiveInputError",
    "CollectiveRuntimeError",
    "CollectiveTypeError",
    "CommStats",
    "Communicator",
    "GradientReducer",
    "NonFiniteError",
    "SparseCollError",
    "SparseRequest",
    "SparseVector",
    "UnknownAlgorithmError",
    "__version__",
    "allreduce",
    "available_algorithms",
    "get_algorithm",
    "get_timeout",
    "iallreduce",
    "register_algorithm",
    "set_timeout",
]
