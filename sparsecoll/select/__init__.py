"""Top-k and threshold selection by |x| for numpy (Numba kernels) and CuPy arrays.

Public functions (one dispatch for numpy, CuPy, and torch tensors, which come back as torch):

    topk(x, k)             -> (indices, values): the k largest |x|, ties to the lower index
    threshold(x, t)        -> (indices, values): every entry with |x| >= t
    count_ge(x, t)         -> int: how many entries have |x| >= t
    kth_largest_abs(x, k)  -> float: the k-th largest |x| (1 <= k <= n)
    moments(x)             -> (mean, std) of x, in float64, from sums of x - c for a c near
                              the mean (no cancellation when |mean| >> std; scaled where
                              squares would pass float64's range: finite for any finite x)
    accumulate(g, r, out=, cut=) -> Accumulation: out = g + r and the entries of out with
                              |out| >= cut, in one pass (error feedback fused with selection;
                              zero_cut= zeroes the likely-sent ones in out, buckets= bins them)
    topk_hits(found, k)    -> (indices, values, taken): the top-k of an Accumulation's entries
    topk_sparse(v, k), threshold_sparse(v, t): the same on a SparseVector's values
    ExactThreshold, ReuseThreshold, SamplingThreshold, GaussianThreshold: estimators that
        turn a requested k (or density) into a threshold and report the achieved count.

Results: indices ascending, of ``sparsecoll._array.index_dtype(n)`` (int32 for n <= 2**31,
else int64), so they form a coalesced SparseVector as they are; values in x's dtype, exact
copies of x at those indices. ``|x| >= t`` is decided exactly (as if in infinite precision),
whatever the dtype of x or t. +-inf counts as the largest |x| and is selected like any value.
NaN: every function raises ValueError (``NAN_MESSAGE``) when x holds a NaN anywhere, whatever
k or t; the check rides along a pass the kernels make anyway. A NaN threshold is an error too.

CPU backends: the Numba kernels (``_numba``), or plain numpy (``_numpy``) where Numba is
missing, when the environment sets ``SPARSECOLL_NO_NUMBA=1``, or after
``set_backend("numpy")``. Both return identical results (``moments`` agrees to rounding).

GPU backend contract -- ``sparsecoll/select/_cupy.py`` is imported lazily, the first time a
CuPy array comes in, and must provide these module-level functions:

    topk(x, k)            -> (indices, values)   0 <= k <= n
    threshold(x, t)       -> (indices, values)
    count_ge(x, t)        -> int
    kth_largest_abs(x, k) -> float               1 <= k <= n
    moments(x)            -> (float, float)      mean and (population) std, computed in float64

where the dispatch has already checked that x is a C-contiguous 1-D CuPy array of float16,
float32 or float64 (any n, 0 included), that k is a Python int in range, and that t is a
Python float, not NaN, >= 0 and exactly representable in x.dtype (rounded up by
``_common.round_threshold``), so ``abs(x) >= t`` evaluated in x.dtype is the exact test (or use
``_common.threshold_key`` and compare keys). Each must: return CuPy arrays, indices ascending
of ``index_dtype(n)``, values in x.dtype; break top-k ties by lower index; raise
``ValueError(_common.NAN_MESSAGE)`` when x holds any NaN; give the same results as ``_numpy``
(the oracle the tests compare against).
"""

from __future__ import annotations

from ._common import NAN_MESSAGE
from ._dispatch import (
    BACKEND_FUNCTIONS,
    Accumulation,
    accumulate,
    backend,
    count_ge,
    get_num_threads,
    kth_largest_abs,
    moments,
    set_backend,
    set_num_threads,
    threshold,
    threshold_sparse,
    topk,
    topk_hits,
    topk_sparse,
    use_backend,
    warmup,
)
from .estimators import (
    ExactThreshold,
    GaussianThreshold,
    ReuseThreshold,
    SamplingThreshold,
    Selection,
    ThresholdEstimator,
)

__all__ = [
    "BACKEND_FUNCTIONS",
    "NAN_MESSAGE",
    "Accumulation",
    "ExactThreshold",
    "GaussianThreshold",
    "ReuseThreshold",
    "SamplingThreshold",
    "Selection",
    "ThresholdEstimator",
    "accumulate",
    "backend",
    "count_ge",
    "get_num_threads",
    "kth_largest_abs",
    "moments",
    "set_backend",
    "set_num_threads",
    "threshold",
    "threshold_sparse",
    "topk",
    "topk_hits",
    "topk_sparse",
    "use_backend",
    "warmup",
]
