"""The dispatch behind ``sparsecoll.select``: validation, backend choice, result wrapping."""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from .._array import as_array, get_array_module, index_dtype
from .._options import env_flag, flag, integer, real
from ..sparse import VALUE_DTYPES, SparseVector
from ._common import round_threshold

__all__ = [
    "BACKEND_FUNCTIONS",
    "Accumulation",
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

# What every backend module provides (the GPU module included).
BACKEND_FUNCTIONS = ("topk", "threshold", "count_ge", "kth_largest_abs", "moments", "accumulate")

_CPU_BACKENDS = ("numba", "numpy")
_choice: str | None = "numpy" if env_flag("SPARSECOLL_NO_NUMBA", False) else None


_LOADED: dict[str, Any] = {}  # backend modules once imported (every selection looks one up)


def _load(name: str) -> Any:
    module = _LOADED.get(name)
    if module is None:
        module = _LOADED[name] = importlib.import_module(f"{__package__}._{name}")
    return module


def _cpu() -> Any:
    if _choice == "numpy":
        return _load("numpy")
    try:
        return _load("numba")
    except ImportError:
        if _choice == "numba":
            raise
        return _load("numpy")


def backend() -> str:
    """The CPU backend in use: ``"numba"`` or ``"numpy"``."""
    return _cpu().__name__.rsplit("_", 1)[-1]


def set_backend(name: str | None) -> None:
    """Choose the CPU backend: ``"numba"``, ``"numpy"``, or None for automatic (Numba when
    it imports)."""
    global _choice
    if name is not None and name not in _CPU_BACKENDS:
        raise ValueError(f"backend must be one of {_CPU_BACKENDS} or None, got {name!r}")
    _choice = name


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Use the CPU backend ``name`` inside a with block."""
    old = _choice
    set_backend(name)
    try:
        yield
    finally:
        set_backend(old)


def _prepare(x: Any) -> tuple[Any, Any, Any]:
    """Return (array, backend module, wrap) for a validated 1-D float input."""
    arr, wrap = as_array(x, "x")
    if getattr(arr, "ndim", None) != 1:
        raise ValueError(f"x must be 1-D, got shape {getattr(arr, 'shape', None)}")
    if arr.dtype not in VALUE_DTYPES:
        raise TypeError(f"x must be float16, float32 or float64, got {arr.dtype}")
    if isinstance(arr, np.ndarray):
        return np.ascontiguousarray(arr), _cpu(), wrap
    return get_array_module(arr).ascontiguousarray(arr), _load("cupy"), wrap


def _integer_k(k: Any) -> None:
    """Raise TypeError unless ``k`` is a Python or numpy integer (not a bool)."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"k must be an integer, got {type(k).__name__}")


def _check_k(k: Any, lo: int, n: int) -> int:
    _integer_k(k)
    if not lo <= k <= n:
        raise ValueError(f"k must be in [{lo}, {n}], got {k}")
    return int(k)


def _check_t(t: Any, dtype: Any) -> float:
    if isinstance(t, bool) or not isinstance(t, (int, float, np.integer, np.floating)):
        raise TypeError(f"t must be a real number, got {type(t).__name__}")
    tf = _float_at_least(t)
    if tf != tf:
        raise ValueError("t must not be NaN")
    return round_threshold(tf, dtype)


def _float_at_least(t: Any) -> float:
    """The smallest Python float >= ``t`` (a real number): ``float(t)`` rounds an integer
    beyond 2**53 or a long double to nearest, maybe below t (2**53 + 1 to 2**53, which
    ``|x| >= t`` must not select), and raises OverflowError beyond float64's range."""
    if isinstance(t, (int, np.integer)):
        i = int(t)  # (compared with a float exactly; a numpy integer is not)
        try:
            tf = float(i)
        except OverflowError:
            return math.inf if i > 0 else -math.inf
        return math.nextafter(tf, math.inf) if tf < i else tf
    tf = float(t)
    if isinstance(t, np.floating) and t.dtype.itemsize > 8 and np.longdouble(tf) < t:
        tf = math.nextafter(tf, math.inf)
    return tf


def topk(x: Any, k: int) -> tuple[Any, Any]:
    """The k entries of largest |x|, exactly; ties go to the lower index.

    Returns:
        (indices, values): indices ascending (``index_dtype(n)``), values = x[indices].
    Raises:
        ValueError: k outside [0, n], or x holds a NaN.
        TypeError: x not a 1-D float16/32/64 array, or k not an integer.
    """
    arr, mod, wrap = _prepare(x)
    k = _check_k(k, 0, arr.shape[0])
    idx, vals = mod.topk(arr, k)
    return wrap(idx), wrap(vals)


def threshold(x: Any, t: float) -> tuple[Any, Any]:
    """Every entry with |x| >= t (exact comparison), indices ascending.

    Equals ``np.flatnonzero(np.abs(x) >= t)`` whenever t is representable in x's dtype.
    """
    arr, mod, wrap = _prepare(x)
    idx, vals = mod.threshold(arr, _check_t(t, arr.dtype))
    return wrap(idx), wrap(vals)


def count_ge(x: Any, t: float) -> int:
    """How many entries have |x| >= t (exact comparison)."""
    arr, mod, _ = _prepare(x)
    return int(mod.count_ge(arr, _check_t(t, arr.dtype)))


def kth_largest_abs(x: Any, k: int) -> float:
    """The k-th largest |x| (1 <= k <= n), as a Python float (exact for every dtype)."""
    arr, mod, _ = _prepare(x)
    k = _check_k(k, 1, arr.shape[0])
    return float(mod.kth_largest_abs(arr, k))


def moments(x: Any) -> tuple[float, float]:
    """Mean and (population) standard deviation of x, accumulated in float64."""
    arr, mod, _ = _prepare(x)
    if arr.shape[0] == 0:
        raise ValueError("moments of an empty array")
    mean, std = mod.moments(arr)
    return float(mean), float(std)


def topk_sparse(v: SparseVector, k: int) -> SparseVector:
    """The k entries of ``v`` with largest |value| (ties to the lower index), coalesced."""
    _check_sparse(v, "topk")
    pos, vals = topk(v.values, k)
    return SparseVector(v.indices[pos], vals, v.n)


def threshold_sparse(v: SparseVector, t: float) -> SparseVector:
    """The entries of ``v`` with |value| >= t, coalesced."""
    _check_sparse(v, "threshold")
    pos, vals = threshold(v.values, t)
    return SparseVector(v.indices[pos], vals, v.n)


def _check_sparse(v: Any, dense: str) -> None:
    """Raise TypeError unless ``v`` is a SparseVector (an array raised AttributeError
    "'numpy.ndarray' object has no attribute 'values'")."""
    if not isinstance(v, SparseVector):
        raise TypeError(
            f"v must be a SparseVector, got {type(v).__name__} (for an array: {dense}(x, ...))"
        )


def warmup(parallel: bool = False) -> None:
    """Compile (or load from Numba's cache) the CPU kernels now, not on the first call;
    with ``parallel`` the multi-threaded versions too (used on arrays of 2**22 keys and up
    when more than one thread is available)."""
    mod = _cpu()
    if hasattr(mod, "warmup"):
        mod.warmup(parallel)


def get_num_threads() -> int:
    """Threads the CPU backend uses (1 for numpy). Numba: the cores this process may run on
    divided by the MPI ranks on its node (read from the launcher's environment), at least 1,
    unless ``SPARSECOLL_NUM_THREADS``/``NUMBA_NUM_THREADS`` or :func:`set_num_threads` say
    otherwise."""
    mod = _cpu()
    return mod.get_num_threads() if hasattr(mod, "get_num_threads") else 1


def set_num_threads(n: int) -> None:
    """Use n threads in the Numba kernels (1 to Numba's pool size); no effect on numpy.

    Raises:
        TypeError: n is no integer (a numpy integer is one).
        ValueError: n below 1, or above Numba's pool on the Numba backend.
    """
    # (checked on numpy too, which took -1 or "2" silently)
    n = integer("threads", n, 1)
    mod = _cpu()
    if hasattr(mod, "set_num_threads"):
        mod.set_num_threads(n)


class Accumulation(NamedTuple):
    """What :func:`accumulate` selected on its pass.

    ``indices``/``values``: the entries of ``out[lo:hi]`` with ``|out| >= cut``, indices
    ascending (global positions), at most ``cap`` of them; ``hits``: how many there were in
    all (``hits > len(indices)`` means the room ran out and the selection is incomplete);
    ``nonfinite``: how many entries of ``out`` are NaN or infinite; ``buckets``: what
    :func:`topk_hits` ranks by (a histogram of the hits, when the backend keeps one);
    ``nonzeros``: how many entries of ``out[lo:hi]`` are not 0 before ``zero_cut``
    zeroes any (with ``nonzeros=True``; else None). An incomplete selection returns no
    entries.
    """

    indices: Any
    values: Any
    hits: int
    nonfinite: int
    buckets: Any = None
    nonzeros: int | None = None

    @property
    def complete(self) -> bool:
        return self.hits == int(self.indices.shape[0])


def accumulate(
    grad: Any,
    residual: Any = None,
    *,
    out: Any,
    cut: float = math.inf,
    lo: int = 0,
    hi: int | None = None,
    cap: int | None = None,
    velocity: Any = None,
    velocity_out: Any = None,
    momentum: float = 0.0,
    zero: Any = None,
    zero_cut: float = math.inf,
    buckets: bool = False,
    workspace: dict | None = None,
    nonzeros: bool = False,
) -> Accumulation:
    """Error feedback and selection in one pass: ``out = grad + residual`` (or ``grad``
    when residual is None), and the entries of ``out[lo:hi]`` with ``|out| >= cut``.

    With ``velocity`` (momentum correction): ``velocity_out = momentum·velocity + grad`` and
    ``out = velocity_out + residual``. ``out`` may be ``residual`` itself and
    ``velocity_out`` may be ``velocity`` (in place); ``grad`` is only read. Reads each input
    once and writes each output once (the Numba kernel and the CuPy kernel; float16 on the
    CPU takes several numpy passes). ``zero`` (optional, same kind) is set to 0 in the same
    pass, e.g. the buffer a sparse update is scattered into afterwards; it may be ``grad``
    (each element is read before it is zeroed). The selected entries with ``|out| >=
    zero_cut`` are 0 in ``out`` (their values are returned): what a caller that sends them
    would zero afterwards, saved a scattered write; nothing is zeroed when the selection
    is incomplete.
    ``buckets`` asks the backend for a histogram of the hits that :func:`topk_hits` uses
    (the Numba backend keeps one; the others ignore it). ``workspace``: a dict the caller
    keeps between calls, where the Numba backend keeps the arrays it returns the hits in;
    they are then valid only until the next call with the same workspace (copy what must
    outlive it). ``nonzeros``: count the entries of ``out[lo:hi]`` that are not 0 (before
    ``zero_cut`` zeroes any), in the pass on the Numba backend.
    NaN and infinities are not raised on but counted in
    ``nonfinite``: a collective caller agrees on them first (every other function of this
    module raises on NaN).

    Args:
        grad, residual, velocity: 1-D float arrays of one length n, dtype and module.
        out, velocity_out: outputs of the same kind (``velocity_out`` with velocity).
        cut: the |value| threshold (``inf``: select nothing but infinities in range); it is
            compared exactly, as in :func:`threshold`.
        lo, hi: the index range selected from (default the whole vector).
        cap: the most entries returned (default ``hi - lo``).
    """
    arr, mod, _ = _prepare(grad)
    n = int(arr.shape[0])
    xp = get_array_module(arr)
    # (int() took lo=1.7 as 1, "1" as 1, hi=True as 1, and cap=-1 as an empty room)
    hi = n if hi is None else integer("hi", hi, 0)
    lo = integer("lo", lo, 0)
    if not 0 <= lo <= hi <= n:
        raise ValueError(f"need 0 <= lo <= hi <= {n}, got lo={lo}, hi={hi}")
    cap = hi - lo if cap is None else min(integer("cap", cap, 0), hi - lo)
    momentum = real("momentum", momentum)
    # (bool() took buckets="no" as True; a workspace of another type raised AttributeError
    # on Numba and was ignored on numpy)
    buckets, nonzeros = flag("buckets", buckets), flag("nonzeros", nonzeros)
    if workspace is not None and not isinstance(workspace, dict):
        raise TypeError(f"workspace must be a dict or None, got {type(workspace).__name__}")
    if (velocity is None) != (velocity_out is None):
        raise ValueError("velocity and velocity_out go together")
    for name, a in (
        ("residual", residual), ("out", out), ("velocity", velocity),
        ("velocity_out", velocity_out), ("zero", zero),
    ):  # fmt: skip
        if a is None:
            continue
        if not isinstance(a, xp.ndarray) or a.dtype != arr.dtype or a.shape != arr.shape:
            raise TypeError(f"{name} must be a {arr.dtype} array of shape {arr.shape} like grad")
        if not a.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
        # (the Numba kernel raised a TypingError of its compiler on a read-only output)
        if name in ("out", "velocity_out", "zero") and xp is np and not a.flags.writeable:
            raise ValueError(f"{name} is read-only")
    t = _check_t(cut, arr.dtype) if cut != math.inf else math.inf
    if t == 0.0:  # zeros are never selected: the smallest positive value instead
        t = float(np.finfo(arr.dtype).smallest_subnormal)
    zc = _check_t(zero_cut, arr.dtype) if zero_cut != math.inf else math.inf
    res = mod.accumulate(
        arr, residual, velocity, velocity_out, momentum, out, zero, t, lo, hi, cap,
        index_dtype(n), zc, buckets, workspace, nonzeros,
    )  # fmt: skip
    return Accumulation(*res)


def topk_hits(found: Accumulation, k: int) -> tuple[Any, Any, Any]:
    """The k entries of largest magnitude among a complete :func:`accumulate` selection:
    ``(indices, values, taken)``, indices ascending, ties to the lower index (as
    :func:`topk`), ``taken`` a boolean mask over the selection's entries marking them.
    With the pass's histogram (``buckets=True`` on the Numba backend) only the bin that
    holds the k-th value is ranked; otherwise :func:`topk` runs on the values."""
    count = int(found.indices.shape[0])
    _integer_k(k)  # (k="2" raised the comparison's own TypeError, '<=' not supported ...)
    if not found.complete or not 0 <= k <= count:
        raise ValueError(f"need a complete selection of at least k={k} entries, got {count}")
    if found.buckets is not None and k > 0 and isinstance(found.values, np.ndarray):
        from . import _numba_train

        got = _numba_train.topk_hits(found.indices, found.values, found.buckets, k)
        if got is not None:
            return got
    pos, vals = topk(found.values, k)
    taken = get_array_module(found.values).zeros(count, dtype=bool)
    taken[pos] = True
    return found.indices[pos], vals, taken
