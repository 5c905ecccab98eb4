"""The Algorithm interface and the pieces algorithms share (folding, ranges, pair packing).

Contract of ``Algorithm.reduce(comm, x)``: called on every rank of ``comm`` with this rank's
*coalesced* local vector ``x`` (sorted unique indices of ``index_dtype(n)``, inputs already
validated collectively); returns a coalesced SparseVector identical on every rank. Exact
algorithms return the sum of every rank's input; selecting algorithms document their own
contract and set ``result.contributed`` (a mask over ``x``'s entries that reached the result)
and ``result.local = x``. Row values (``x.width`` not None: an index per row of D values)
reach only algorithms with ``takes_rows``; the result has rows of the same width.
"""

from __future__ import annotations

import dataclasses
import inspect
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

from .._array import aligned_view, get_array_module, index_dtype, nonzero_positions, to_host
from .._state import Kind, check_saved
from ..comm import Communicator
from ..sparse import SparseVector, coalesce

__all__ = [
    "Algorithm",
    "Fold",
    "RangeLayout",
    "allclose_sparse",
    "dense_of",
    "input_mass",
    "pack_pairs",
    "range_bounds",
    "recv_pairs",
    "reference_sum",
    "sparse_is_cheaper",
    "state_crc",
    "unpack_pairs",
]


class Algorithm(ABC):
    """Base class of every sparse allreduce algorithm.

    Class attributes:
        name: the registry name.
        exact: True when the result is the exact sum of every rank's input.
        takes_rows: True when ``reduce`` takes row values (shape ``(nnz, D)``); the others
            are refused rows, on every rank, before the call.
        densifies: True when the algorithm needs O(n) memory per rank.
        required: options without which the constructor fails (a selecting algorithm's
            k), listed as required though their default is None.
        state_kinds: the attributes that calls change (what a GradientReducer checkpoint
            restores), each with its kind (:mod:`sparsecoll._state`); None: not declared
            (every attribute restored as saved).
        state_version: the version of that state's meaning, saved with it: raise it when
            an attribute keeps its name but changes what it holds, so old states are
            refused instead of misread.
        fixed_options: constructor options kept as attributes of the same name; setting
            or deleting one later raises AttributeError (build a new instance instead).
        settle_calls: how many calls an instance makes before it runs as it will from then
            on (auto: the calls that measure its contenders); benchmarks of the steady
            state warm up at least that many.

    Options are the constructor's parameters, documented in the class docstring's ``Args:``
    section, which :func:`sparsecoll.get_algorithm` and the registry's listing read. An
    algorithm without options defines no ``__init__``.
    """

    name: ClassVar[str] = ""
    exact: ClassVar[bool] = True
    takes_rows: ClassVar[bool] = False
    densifies: ClassVar[bool] = False
    required: ClassVar[tuple[str, ...]] = ()
    state_kinds: ClassVar[dict[str, Kind] | None] = None
    state_version: ClassVar[int] = 1
    fixed_options: ClassVar[tuple[str, ...]] = ()
    settle_calls: int = 0

    def __setattr__(self, name: str, value: Any) -> None:
        # fixed options are set once, by the constructor, which checks them; the
        # signature and the state of earlier calls are built for that value
        if name in self.fixed_options and name in self.__dict__:
            self._refuse(name, value)
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if name in self.fixed_options:
            self._refuse(name, None, deleted=True)
        object.__delattr__(self, name)

    def _refuse(self, name: str, value: Any, *, deleted: bool = False) -> None:
        change = "deleted" if deleted else f"got {value!r}"
        raise AttributeError(
            f"algorithm {self.name!r}'s {name} is fixed at construction (checked there; "
            f"its signature and the state of its calls are built for it), {change}: "
            f"build a new instance on every rank, e.g. "
            f"sparsecoll.get_algorithm({self.name!r}, {name}=...)"
        )

    def __init__(self, **options: Any) -> None:
        # an algorithm without options takes none (its signature says so, below); the
        # keywords are caught only to fail with a clear message, however it is built
        if options:
            raise TypeError(
                f"algorithm {self.name!r} takes no options, got {', '.join(sorted(options))}"
            )

    __init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    )

    @abstractmethod
    def reduce(self, comm: Communicator, x: SparseVector) -> SparseVector:
        """Reduce ``x`` over ``comm``; see the module docstring for the contract."""

    def preflight(self, x: SparseVector) -> None:
        """Do the local work of :meth:`reduce` that can fail on this rank alone, ahead.

        Called before the ranks agree on the call, so that such an error (an O(n) allocation) is
        raised on every rank. It puts what it makes in ``x.info``; ``reduce`` works without it.
        """
        return None

    @classmethod
    def default_options(cls, n: int, k: int) -> dict[str, Any]:
        """Return options for length ``n`` and about ``k`` nonzeros per rank (benchmarks)."""
        return {}

    def signature(self) -> list[int]:
        """Return integers that must agree on every rank (e.g. k): at most 5, each within int64."""
        return []

    def check_state(self, saved: dict[str, Any], n: int, size: int) -> dict[str, Any]:
        """Return the attributes to restore from the checkpoint state ``saved``, checked.

        Raises ValueError (TypeError for a wrong type) naming what does not fit ``n`` and ``size``
        ranks; changes nothing. Override to check how the attributes fit together.
        """
        return check_saved(self, saved, n, size)

    def verify(
        self, result: SparseVector, reference: SparseVector, inputs: list[SparseVector]
    ) -> bool:
        """Return whether ``result`` meets the contract, given the exact sum of ``inputs``.

        Exact algorithms: ``reference`` within :func:`allclose_sparse`'s rounding.
        """
        return allclose_sparse(result, reference, inputs)

    def __repr__(self) -> str:
        return f"<sparsecoll algorithm {self.name!r}>"


def state_crc(values: Any, bounds: Any = None) -> int:
    """Return a CRC of ``values``' repr and the int64 ``bounds`` (None: none) for signature()."""
    crc = zlib.crc32(repr(values).encode())
    if bounds is not None:
        crc = zlib.crc32(np.ascontiguousarray(bounds, np.int64).tobytes(), crc)
    return crc


def dense_of(x: SparseVector) -> Any:
    """Return ``x`` as a new dense array: the one :meth:`Algorithm.preflight` made, or now."""
    dense = x.info.pop("dense", None)
    return x.to_dense() if dense is None else dense


def _dense_on(union: np.ndarray, indices: Any, values: Any) -> np.ndarray:
    """Place ``values`` (float64) at ``indices`` among the ascending ``union``, 0 elsewhere."""
    out = np.zeros((union.shape[0], *values.shape[1:]))
    out[np.searchsorted(union, np.asarray(to_host(indices)).astype(np.int64))] = np.asarray(
        to_host(values), dtype=np.float64
    )
    return out


def input_mass(inputs: list[SparseVector], at: np.ndarray) -> np.ndarray:
    """Return Σ_r |x_r[i]| (float64) at each index of ``at``: it bounds the rounding of a sum."""
    mass = np.zeros((at.shape[0], *inputs[0].row_shape) if inputs else at.shape[0])
    for x in inputs:
        xi = np.asarray(to_host(x.indices)).astype(np.int64)
        pos = np.minimum(np.searchsorted(at, xi), max(at.shape[0] - 1, 0))
        hit = at[pos] == xi if at.shape[0] else np.zeros(xi.shape[0], bool)
        np.add.at(mass, pos[hit], np.abs(np.asarray(to_host(x.values), np.float64)[hit]))
    return mass


def reference_sum(inputs: list[SparseVector]) -> SparseVector:
    """Return the exact sum of every rank's input, computed apart from any algorithm.

    Summed in float64 and rounded once to the inputs' dtype; a sum that cancels is an explicit 0.
    """
    n, dtype = inputs[0].n, inputs[0].values.dtype
    idx = [np.asarray(to_host(x.indices)).astype(np.int64) for x in inputs]
    union, inverse = np.unique(np.concatenate(idx), return_inverse=True)
    vals = np.concatenate([np.asarray(to_host(x.values), np.float64) for x in inputs])
    sums = np.zeros((union.shape[0], *vals.shape[1:]))
    np.add.at(sums, inverse.reshape(-1), vals)
    return SparseVector(union.astype(index_dtype(n)), sums.astype(dtype), n)


def allclose_sparse(a: SparseVector, b: SparseVector, inputs: list[SparseVector]) -> bool:
    """Return whether two sums ``a`` and ``b`` of ``inputs`` (P of them) agree index by index.

    Tolerance: ``|a[i] - b[i]| <= P·eps·Σ_r |x_r[i]|`` plus P of the dtype's smallest
    subnormals. P terms summed in any order, each partial sum rounded in the dtype, are
    within (P − 1)·u·Σ|x_r[i]| of the exact sum (u = eps/2), and a reference rounded once
    within u·|sum|: P·eps is twice their total. Equal values (infinities too) always match;
    the bound is per index, so a result missing a small term fails.
    """
    if a.n != b.n:
        return False
    ia = np.asarray(to_host(a.indices)).astype(np.int64)
    ib = np.asarray(to_host(b.indices)).astype(np.int64)
    union = np.union1d(ia, ib)
    da, db = _dense_on(union, ia, a.values), _dense_on(union, ib, b.values)
    finfo = np.finfo(a.values.dtype)
    p = max(len(inputs), 1)
    tol = p * float(finfo.eps) * input_mass(inputs, union) + p * float(finfo.smallest_subnormal)
    with np.errstate(invalid="ignore"):
        return bool(np.all((da == db) | (np.abs(da - db) <= tol)))


# -- shared building blocks --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fold:
    """How a rank takes part in a power-of-two algorithm when P is not a power of two.

    The first ``2 r`` ranks (``r = P - 2^floor(log2 P)``) pair up: each even rank hands its
    data to the odd rank above it before the algorithm and gets the result back after (as
    MPICH does). ``newrank``: the rank in the power-of-two group, -1 for a folded rank;
    ``partner``: the rank it pairs with, or -1.
    """

    rank: int
    size: int
    pof2: int
    newrank: int
    partner: int

    @classmethod
    def plan(cls, rank: int, size: int) -> Fold:
        pof2 = 1 << (size.bit_length() - 1)
        rem = size - pof2
        if rank < 2 * rem:
            if rank % 2 == 0:
                return cls(rank, size, pof2, -1, rank + 1)
            return cls(rank, size, pof2, rank // 2, rank - 1)
        return cls(rank, size, pof2, rank - rem, -1)

    @property
    def folded(self) -> bool:
        """True for a rank that sits out the power-of-two part."""
        return self.newrank < 0

    def real_rank(self, newrank: int) -> int:
        """The communicator rank of power-of-two member ``newrank``."""
        rem = self.size - self.pof2
        return newrank * 2 + 1 if newrank < rem else newrank + rem


def range_bounds(n: int, parts: int) -> np.ndarray:
    """Return ``parts + 1`` int64 bounds of near-equal ranges of [0, n).

    Computed in Python ints: ``i * n`` overflows int64 for n above 2**63 / parts.
    """
    if not parts:
        return np.zeros(1, np.int64)
    return np.array([i * n // parts for i in range(parts + 1)], dtype=np.int64)


def region_cuts(indices: Any, bounds: np.ndarray) -> list[int]:
    """Return where each region starts in the ascending ``indices`` (``len(bounds)`` cuts).

    The first cut is 0 and the last ``len(indices)``. Bounds are searched in the indices'
    dtype where it holds them: int64 keys would convert a whole int32 index array first.
    """
    cuts = search_sorted(indices, bounds)
    cuts[0], cuts[-1] = 0, int(indices.shape[0])
    return cuts


def search_sorted(indices: Any, keys: Any) -> list[int]:
    """Where each key would go in the ascending ``indices`` (left side), on the host.

    Keys are searched in the indices' dtype where it holds them: int64 keys would convert
    a whole int32 index array first.
    """
    xp = get_array_module(indices)
    keys = np.asarray(keys, np.int64)
    fits = keys.size == 0 or int(keys.max()) <= np.iinfo(indices.dtype).max
    dtype = indices.dtype if fits else keys.dtype
    return [int(c) for c in to_host(xp.searchsorted(indices, xp.asarray(keys, dtype=dtype)))]


def sparse_is_cheaper(
    nnz: int, length: int, itype: Any, vtype: Any, width: int | None = None
) -> bool:
    """Apply the break-even rule: sparse while nnz·(index + D·value bytes) < length·D·value
    bytes, D the values per index (``width``; None: 1-D values, D = 1)."""
    isz = np.dtype(itype).itemsize
    vsz = np.dtype(vtype).itemsize * (width or 1)
    return nnz * (isz + vsz) < length * vsz


class RangeLayout:
    """Where each range of reduced entries lands in a result's index and value arrays.

    ``counts[j]``: range j's nnz, or its length when it is held dense; every rank builds the
    same layout from the same counts, so ranges are received straight into their places, a
    range past the break-even rule as its dense values. ``bounds``: the ranges' R + 1 bounds.
    """

    def __init__(self, counts: Any, bounds: np.ndarray, n: int, vtype: Any, xp: Any) -> None:
        self.n, self.bounds = n, [int(b) for b in bounds]
        self.itype, self.vtype = index_dtype(n), np.dtype(vtype)
        lengths = np.diff(self.bounds).tolist()
        counts = [int(c) for c in counts]
        self.dense = [
            not sparse_is_cheaper(c, ln, self.itype, self.vtype) for c, ln in zip(counts, lengths)
        ]
        icount = [0 if d else c for d, c in zip(self.dense, counts)]
        vcount = [ln if d else c for d, ln, c in zip(self.dense, lengths, counts)]
        self.ioff = np.concatenate(([0], np.cumsum(icount))).astype(np.int64).tolist()
        self.voff = np.concatenate(([0], np.cumsum(vcount))).astype(np.int64).tolist()
        self.indices = xp.empty(self.ioff[-1], self.itype)
        self.values = xp.empty(self.voff[-1], self.vtype)

    def put(self, j: int, run: tuple[Any, Any]) -> None:
        """Place range j's ``(indices, values)``, or ``(None, dense values)``."""
        if run[0] is not None:
            self.indices[self.ioff[j] : self.ioff[j + 1]] = run[0]
        self.values[self.voff[j] : self.voff[j + 1]] = run[1]

    def pieces(self, first: int, count: int) -> Iterator[tuple[Any, int, int]]:
        """``(array, lo, hi)`` of ranges first … first + count − 1 (mod R): the indices'
        spans, then the values' (empty ones left out)."""
        total = len(self.dense)
        spans = [(first, min(first + count, total))]
        if first + count > total:
            spans.append((0, first + count - total))
        for arr, off in ((self.indices, self.ioff), (self.values, self.voff)):
            for a, b in spans:
                if off[b] > off[a]:
                    yield arr, off[a], off[b]

    def result(self) -> SparseVector:
        """The gathered vector; ranges held dense give their nonzero entries."""
        if not any(self.dense):
            return SparseVector(self.indices, self.values, self.n)
        xp = get_array_module(self.values)
        pieces_i, pieces_v = [], []
        for j, dense in enumerate(self.dense):
            vals = self.values[self.voff[j] : self.voff[j + 1]]
            if dense:
                nz = nonzero_positions(vals)
                pieces_i.append((nz + self.bounds[j]).astype(self.itype))
                pieces_v.append(vals[nz])
            else:
                pieces_i.append(self.indices[self.ioff[j] : self.ioff[j + 1]])
                pieces_v.append(vals)
        return SparseVector(xp.concatenate(pieces_i), xp.concatenate(pieces_v), self.n)


def pack_pairs(indices: Any, values: Any) -> Any:
    """Pack the indices then the values (rows: row after row) into one byte buffer (no
    float-packed ints)."""
    xp = get_array_module(values)
    out = xp.empty(indices.nbytes + values.nbytes, dtype=np.uint8)
    out[: indices.nbytes] = indices.view(np.uint8)
    out[indices.nbytes :] = xp.ascontiguousarray(values).reshape(-1).view(np.uint8)
    return out


def unpack_pairs(buf: Any, itype: Any, vtype: Any, width: int | None = None) -> tuple[Any, Any]:
    """Split a :func:`pack_pairs` buffer into (indices, values) views, copying a misaligned
    part; ``width``: the values are rows of that many (None: 1-D)."""
    isz = np.dtype(itype).itemsize
    vsz = np.dtype(vtype).itemsize * (width or 1)
    m = buf.shape[0] // (isz + vsz)
    vals = aligned_view(buf[m * isz :], vtype)
    return aligned_view(buf[: m * isz], itype), vals if width is None else vals.reshape(m, width)


def recv_pairs(
    comm: Communicator,
    source: int,
    tag: int,
    n: int,
    vtype: Any,
    xp: Any = np,
    width: int | None = None,
):
    """Receive a pair buffer of unknown length from ``source`` into an array of ``xp``."""
    buf = comm.recv_bytes(source, tag, xp)
    return unpack_pairs(buf, index_dtype(n), vtype, width)


def merge(
    parts: list[tuple[Any, Any]], n: int, dtype: Any, xp: Any = np, width: int | None = None
) -> SparseVector:
    """Coalesce several (indices, values) pieces into one vector (sums repeats, in order)."""
    parts = [p for p in parts if p[0].shape[0]]
    if not parts:
        return SparseVector.empty(n, dtype, xp, width)
    if len(parts) == 1:
        return coalesce(parts[0][0], parts[0][1], n)
    return coalesce(xp.concatenate([p[0] for p in parts]), xp.concatenate([p[1] for p in parts]), n)
