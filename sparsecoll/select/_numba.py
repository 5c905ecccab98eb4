"""The Numba CPU backend: the functions every selection backend provides.

Selection kernels: ``_numba_select``; the training step's fused pass: ``_numba_train``;
threads and chunking: ``_numba_core``.
"""

from __future__ import annotations

import numpy as np

from . import _numba_core as core
from ._numba_core import get_num_threads, set_num_threads
from ._numba_select import count_ge, kth_largest_abs, moments, threshold, topk
from ._numba_train import accumulate

__all__ = [
    "accumulate",
    "count_ge",
    "get_num_threads",
    "kth_largest_abs",
    "moments",
    "set_num_threads",
    "threshold",
    "topk",
    "warmup",
]


def warmup(parallel: bool = False) -> None:
    """Compile (or load from the cache) every serial kernel for every dtype, and with
    ``parallel`` the parallel ones too (that also starts Numba's thread pool)."""
    saved = core.PARALLEL_MIN
    for big in (False, True) if parallel and get_num_threads() > 1 else (False,):
        core.PARALLEL_MIN = 1 if big else saved
        try:
            for dt in (np.float16, np.float32, np.float64):
                x = np.linspace(-1.0, 1.0, 64).astype(dt)
                topk(x, 5)  # int32 indices; int64 ones (n > 2**31) compile on first use
                threshold(x, 0.5)
                kth_largest_abs(x, 3)
                count_ge(x, 0.5)
                moments(x)
        finally:
            core.PARALLEL_MIN = saved
