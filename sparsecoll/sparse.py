"""SparseVector: a COO sparse vector of length n with host (numpy) or device (CuPy) buffers.

Contract of a *coalesced* vector: ``indices`` strictly ascending (sorted, unique), every
index in ``[0, n)``, ``indices.dtype`` is int32 when ``n <= 2**31`` and int64 otherwise,
``values`` has the same length and a float dtype (float16/32/64). Explicit zeros may be
present: they are structural entries, not dropped.

Values may be rows: shape ``(nnz, D)``, one index per row of D values (a hybrid COO tensor
with one sparse and one dense dimension, as torch calls it); the dense form is ``(n, D)``
and a repeated index sums its rows elementwise. Row values are C-contiguous.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._array import (
    as_array,
    device_scope,
    get_array_module,
    index_dtype,
    is_device_array,
    nonzero_positions,
    same_device,
    segment_sum,
    stable_argsort,
    wait_for_foreign,
)

__all__ = [
    "VALUE_DTYPES",
    "SparseVector",
    "as_indices",
    "check_local",
    "check_same_device",
    "coalesce",
]

VALUE_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
_INT64_MAX = 2**63 - 1


class SparseVector:
    """A sparse vector of length ``n`` in COO form (``indices``, ``values``).

    Build one with :meth:`from_coo` (validates and coalesces) or :meth:`from_dense`;
    the plain constructor trusts its arrays (only n is checked) and is meant for internal use.

    Attributes:
        indices: sorted unique indices (int32 for n <= 2**31, else int64).
        values: the values at those indices: shape ``(nnz,)``, or ``(nnz, D)`` for rows.
        n: the dense length (in rows, for row values).
        contributed: for results of selecting algorithms, a boolean mask aligned with this
            rank's coalesced input telling which of its entries reached the result
            (None for exact algorithms, where every entry does).
        local: for results of selecting algorithms, this rank's coalesced input.
        info: ``info["stats"]``, a :class:`sparsecoll.CommStats` of what this rank moved
            in the call that returned it (and ``info["auto_choice"]`` for ``auto``).

    Example::

        >>> import sparsecoll
        >>> v = sparsecoll.SparseVector.from_coo([4, 1, 4], [1.0, 2.0, 3.0], n=6)
        >>> v.indices, v.values, v.nnz
        (array([1, 4], dtype=int32), array([2., 4.]), 2)
        >>> v.to_dense()
        array([0., 2., 0., 0., 4., 0.])
    """

    __slots__ = ("contributed", "indices", "info", "local", "n", "values")

    def __init__(self, indices: Any, values: Any, n: int) -> None:
        self.indices = indices
        self.values = values
        # the length is checked even here: int() would take 5.5 as 5 and "7" as 7
        self.n = _length(n)
        self.contributed: Any = None
        self.local: SparseVector | None = None
        self.info: dict[str, Any] = {}

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_coo(cls, indices: Any, values: Any, n: int) -> SparseVector:
        """Validate COO input on this rank and return the coalesced vector.

        ``indices`` and ``values`` may be anything :func:`sparsecoll.allreduce` takes
        (numpy/CuPy arrays, torch tensors, lists, buffers); torch in, torch out. Values of
        shape ``(nnz, D)`` are rows.
        """
        vals, wrap = as_array(values, "values")
        idx = as_indices(indices)
        check_same_device(idx, vals)
        with device_scope(vals):  # the checks' kernels too run on the inputs' GPU
            check_local(idx, vals, n)
            x = coalesce(idx, vals, int(n))
            # the vector owns its arrays (coalesce returns coalesced input as is), as
            # allreduce's results do: writing to one leaves the other
            if x.indices is idx:
                x.indices = idx.copy()
            if x.values is vals:
                x.values = vals.copy()
            return _wrapped(x, wrap)

    @classmethod
    def from_dense(cls, x: Any) -> SparseVector:
        """Return the nonzeros of a dense float16/32/64 array (torch in, torch out): of a
        1-D array its nonzero entries, of a 2-D ``(n, D)`` one the rows holding a nonzero."""
        arr, wrap = as_array(x, "x")
        if getattr(arr, "ndim", None) not in (1, 2):
            raise ValueError(
                f"x must be a 1-D or 2-D array, got shape {getattr(arr, 'shape', None)}"
            )
        if arr.dtype not in VALUE_DTYPES:
            raise TypeError(f"x must be float16, float32 or float64, got {arr.dtype}")
        n = int(arr.shape[0])
        with device_scope(arr):
            idx = nonzero_positions(arr).astype(index_dtype(n), copy=False)
            return _wrapped(cls(idx, arr[idx], n), wrap)

    @classmethod
    def empty(
        cls, n: int, dtype: Any = np.float32, xp: Any = np, width: int | None = None
    ) -> SparseVector:
        """Return a vector of length ``n`` without entries (``width``: rows of that many)."""
        shape = (0,) if width is None else (0, int(width))
        return cls(xp.zeros(0, index_dtype(n)), xp.zeros(shape, dtype), n)

    # -- views --------------------------------------------------------------------------
    @property
    def nnz(self) -> int:
        return len(self.indices)  # the plain constructor may hold lists

    @property
    def shape(self) -> tuple[int, ...]:
        """``(n,)``, the dense shape, as numpy's: ``(n, D)`` for rows."""
        return (self.n, *self.row_shape)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """What one index holds: ``()`` for 1-D values, ``(D,)`` for rows."""
        return tuple(int(d) for d in getattr(self.values, "shape", (0,))[1:])

    @property
    def width(self) -> int | None:
        """D, the values per index of row values; None for 1-D values."""
        row = self.row_shape
        return row[0] if row else None

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    @property
    def xp(self) -> Any:
        return get_array_module(self.values)

    def to_dense(self, out: Any = None) -> Any:
        """Return a dense array of shape ``(n,)`` (rows: ``(n, D)``), of the kind and dtype of
        ``values``.

        Args:
            out: an array to fill and return instead of a new one (as scipy's
                ``toarray(out=)``): the dense shape, the values' dtype, on their device
                (numpy or a torch CPU tensor for host values, CuPy on their GPU), writable,
                strided or not.
        """
        vals, wrap = as_array(self.values, "values", writable=True)
        idx, _ = as_array(self.indices, "indices", writable=True)
        xp = get_array_module(vals)
        if out is None:
            with device_scope(vals):
                dense = xp.zeros((self.n, *vals.shape[1:]), dtype=vals.dtype)
                dense[idx] = vals
            return wrap(dense)
        buf = _dense_out(out, vals, (self.n, *vals.shape[1:]))
        with device_scope(vals):
            # an out that holds the vector's own arrays: zeroing it would lose them
            if xp.may_share_memory(buf, vals):
                vals = vals.copy()
            if xp.may_share_memory(buf, idx):
                idx = idx.copy()
            buf[...] = 0
            buf[idx] = vals
            wait_for_foreign(out, buf)
        return out

    def __len__(self) -> int:
        return self.n

    def __bool__(self) -> bool:
        # ambiguous, as numpy's arrays are: "has entries" and "has a length" differ
        raise ValueError(
            "the truth value of a SparseVector is ambiguous: use v.nnz > 0 (it has entries) "
            "or v.n > 0 (its length)"
        )

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """``np.asarray(v)``: the dense array (as :meth:`to_dense`), always a new one."""
        if copy is False:
            raise ValueError("a SparseVector's dense array is a new array: copy=False is refused")
        return np.asarray(self.to_dense(), dtype=dtype)

    def __repr__(self) -> str:
        dtype = getattr(self.values, "dtype", type(self.values).__name__)
        rows = "" if self.width is None else f", width={self.width}"
        return f"SparseVector(n={self.n}, nnz={self.nnz}, dtype={dtype}{rows})"


def _length(n: Any) -> int:
    """Return ``n`` (a Python or numpy integer >= 0, not a bool) as an int."""
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"n must be an integer, got {type(n).__name__}")
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    return int(n)


def _dense_out(out: Any, vals: Any, shape: tuple[int, ...]) -> Any:
    """Return ``out`` (:meth:`SparseVector.to_dense`'s) as a checked array to write into."""
    buf, _ = as_array(out, "out", writable=True)
    if not same_device(buf, vals):
        where = "on their GPU" if is_device_array(vals) else "on the host"
        raise TypeError(f"out must live where the values do ({where})")
    if tuple(buf.shape) != shape:
        raise ValueError(f"out must have shape {shape}, got {tuple(buf.shape)}")
    for size, step in zip(shape, buf.strides):
        if size > 1 and abs(step) < buf.dtype.itemsize:
            # a broadcast or expanded view (torch's expand()): every write lands on the
            # same memory; torch refuses such an in-place write too
            raise ValueError(
                f"out's elements share memory (a stride of {step} bytes for "
                f"{buf.dtype.itemsize}-byte elements: a broadcast or expanded view): pass an "
                f"array of shape {shape}"
            )
    if buf.dtype.newbyteorder("=") != vals.dtype.newbyteorder("="):
        raise TypeError(f"out must be {vals.dtype} (the values' dtype), got {buf.dtype}")
    if isinstance(buf, np.ndarray) and not buf.flags.writeable:
        raise ValueError("out is read-only")
    return buf


def _wrapped(x: SparseVector, wrap: Any) -> SparseVector:
    """Convert ``x``'s arrays back to the caller's kind with ``wrap``; return ``x``."""
    x.indices, x.values = wrap(x.indices), wrap(x.values)
    return x


def as_indices(indices: Any) -> Any:
    """Return ``indices`` as an array; an empty list, tuple or range as int64 (numpy: float64)."""
    idx, _ = as_array(indices, "indices")
    if isinstance(indices, (list, tuple, range)):
        if not len(indices):
            idx = idx.astype(np.int64)
        elif idx.dtype.kind not in "iu":
            _beyond_int64(indices)
    return idx


def _beyond_int64(indices: list[Any] | tuple[Any, ...] | range) -> None:
    """Raise ValueError when ``indices`` are integers but one lies beyond int64 (numpy: floats)."""
    ints = []
    for i in indices:  # a bool is 0 or 1 here, as numpy reads it in a list of ints
        if not isinstance(i, (int, np.integer, np.bool_)):
            return
        ints.append(int(i))
    bad = next((i for i in ints if not -(2**63) <= i < 2**63), None)
    if bad is not None:
        raise ValueError(f"index {bad} out of range (indices lie in [0, n), n < 2**63)")


_SWAPPED = (
    " (and indices are floats: swapped? allreduce(comm, values, indices, n=) takes values"
    " first, SparseVector.from_coo(indices, values, n) indices first)"
)


def check_same_device(indices: Any, values: Any) -> None:
    """Raise TypeError unless ``indices`` and ``values`` are both on the host or on one GPU."""
    if get_array_module(indices) is not get_array_module(values):
        raise TypeError("values and indices must live on the same device")
    if not same_device(indices, values):
        raise TypeError(
            f"values and indices must live on the same device, got GPU {values.device.id} "
            f"and GPU {indices.device.id}"
        )


def check_local(indices: Any, values: Any, n: Any) -> None:
    """Raise ValueError/TypeError when this rank's COO input breaks the contract."""
    _length(n)
    if n > _INT64_MAX:
        raise ValueError(f"n must be below 2**63 (indices are int64 at most), got {n}")
    if getattr(values, "ndim", None) not in (1, 2):
        raise ValueError(
            f"values must be 1-D, or 2-D rows (nnz, D), got shape {getattr(values, 'shape', None)}"
        )
    if values.ndim == 2 and values.shape[1] < 1:
        raise ValueError(f"row values need at least one value a row, got shape {values.shape}")
    if getattr(indices, "ndim", None) != 1:
        raise ValueError(f"indices must be 1-D, got shape {getattr(indices, 'shape', None)}")
    if values.dtype not in VALUE_DTYPES:
        swapped = values.dtype.kind in "iu" and indices.dtype in VALUE_DTYPES
        raise TypeError(
            f"values must be float16, float32 or float64, got {values.dtype}"
            + (_SWAPPED if swapped else "")
        )
    if indices.dtype.kind not in "iu":
        raise TypeError(f"indices must be integers, got {indices.dtype}")
    if indices.shape[0] != values.shape[0]:
        raise ValueError(
            f"indices and values differ in length: {indices.shape[0]} != {values.shape[0]}"
        )
    if indices.shape[0]:
        # the array methods: numpy's and CuPy's alike, without xp.min's dispatch
        lo = int(indices.min())
        hi = int(indices.max())
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            raise ValueError(f"index {bad} out of range [0, {n})")


def coalesce(indices: Any, values: Any, n: int) -> SparseVector:
    """Sort by index and sum repeated indices (COO semantics; rows elementwise). Inputs are
    not modified."""
    xp = get_array_module(values)
    itype = index_dtype(n)
    m = indices.shape[0]
    if m == 0:
        return SparseVector(xp.zeros(0, itype), xp.zeros(values.shape, values.dtype), n)
    idx = indices.astype(itype, copy=False)
    if m == 1 or bool((idx[1:] > idx[:-1]).all()):
        # strided input (x[::2]) is copied: buffers go to MPI as contiguous bytes
        return SparseVector(xp.ascontiguousarray(idx), xp.ascontiguousarray(values), n)
    order = stable_argsort(idx, n)
    idx = idx[order]
    vals = values[order]
    start = xp.ones(m, dtype=bool)
    start[1:] = idx[1:] != idx[:-1]
    heads = xp.flatnonzero(start)
    if heads.shape[0] == m:
        return SparseVector(idx, vals, n)
    # Sum in a wider type so float16 repeats do not lose more than one rounding. IEEE sums,
    # as allreduce's: an overflow is inf and inf - inf NaN, without a warning.
    acc = vals.astype(np.float64) if vals.dtype == np.float16 else vals
    with np.errstate(over="ignore", invalid="ignore"):
        summed = segment_sum(acc, heads).astype(values.dtype, copy=False)
    return SparseVector(idx[heads], summed, n)
