"""Shared inputs and the one oracle for collective tests.

A drawn ``Case`` is the same on every rank (derandomized hypothesis); each rank derives its
own data from ``(seed, rank)``, and every rank can rebuild every other rank's input, so the
oracle (the exact sum, in float64, kept sparse so that huge n works) needs no communication.
A case with a ``width`` has row values: shape ``(nnz, width)``, one index per row.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
from hypothesis import strategies as st

from sparsecoll import SparseVector
from sparsecoll._array import index_dtype

KINDS = (
    "random",
    "disjoint",
    "same",
    "one_empty",
    "all_empty",
    "repeated",
    "skewed",
    "one_dense",
    "mixed_density",
)
DTYPES = ("float16", "float32", "float64")
HUGE_N = 2**22  # above this, algorithms that densify are skipped
WIDTHS = (1, 3, 16)  # row widths drawn by cases(rows=True)


@dataclasses.dataclass(frozen=True)
class Case:
    n: int
    kind: str
    dtype: str
    seed: int
    density: float
    wide_indices: bool  # pass int64 indices even when int32 would do
    width: int | None = None  # row values of this many (None: 1-D values)

    @property
    def huge(self) -> bool:
        return self.n * (self.width or 1) > HUGE_N


@st.composite
def cases(draw, kinds=KINDS, max_n: int = 2**40, dtypes=DTYPES, rows: bool = False) -> Case:
    """A Case; with ``rows``, one with row values of a width drawn from ``WIDTHS``."""
    n = draw(
        st.one_of(
            st.integers(1, 64),
            st.integers(65, 5000),
            st.sampled_from([1, 2, 7, 4096, 100_003]),
            st.integers(2**31 - 2, max_n) if max_n > 2**31 else st.integers(1, max_n),
        ).filter(lambda v: v <= max_n)
    )
    return Case(
        n=n,
        kind=draw(st.sampled_from(kinds)),
        dtype=draw(st.sampled_from(dtypes)),
        seed=draw(st.integers(0, 2**32 - 1)),
        density=draw(st.sampled_from([0.0, 0.001, 0.01, 0.1, 0.3, 0.9, 1.0])),
        wide_indices=draw(st.booleans()),
        width=draw(st.sampled_from(WIDTHS)) if rows else None,
    )


def local_input(case: Case, rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's (values, indices) for ``case``: unsorted, possibly with repeats."""
    rng = np.random.default_rng([case.seed, rank])
    n = case.n
    k = min(round(case.density * n), 300)
    kind = case.kind
    if kind == "all_empty" or (kind == "one_empty" and rank == size - 1):
        k = 0
    if kind == "one_dense" and rank == 0 and n <= 5000:
        idx = np.arange(n, dtype=np.int64)
    elif kind == "mixed_density" and n <= 5000:
        # rank 0 fills the lower ranges densely, the rest stay sparse
        lo_hi = max(1, n // max(size, 1))
        idx = np.arange(lo_hi) if rank == 0 else rng.integers(0, n, size=k)
    elif kind == "same":
        idx = (
            np.random.default_rng([case.seed, 10**6]).choice(n, size=min(k, n), replace=False)
            if n <= 10**7
            else np.random.default_rng([case.seed, 10**6]).integers(0, n, size=k)
        )
    elif kind == "disjoint":
        lo, hi = rank * n // size, (rank + 1) * n // size
        idx = rng.integers(lo, hi, size=k if hi > lo else 0)
    elif kind == "skewed":
        hot = max(1, n // 10)
        k_hot = int(0.9 * k)
        idx = np.concatenate([rng.integers(0, hot, size=k_hot), rng.integers(0, n, size=k - k_hot)])
    elif kind in ("repeated", "cancel"):
        idx = rng.integers(0, max(1, min(n, 8)), size=k)  # many repeats of few indices
    else:
        idx = rng.integers(0, n, size=k)
    idx = rng.permutation(np.asarray(idx, dtype=np.int64))
    shape = idx.shape if case.width is None else (idx.shape[0], case.width)
    vals = rng.standard_normal(shape).astype(case.dtype)
    if kind == "cancel":  # small integers (exact in every dtype) cancel to 0; zeros of both signs
        sign = rng.choice([-1.0, 1.0], size=shape)
        vals = (rng.integers(-2, 3, size=shape) * sign).astype(case.dtype)
    itype = np.int64 if case.wide_indices else index_dtype(n)
    return vals, idx.astype(itype)


def oracle(case: Case, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(indices, exact float64 sums, sums of |contributions|) over every rank's input."""
    parts = [local_input(case, r, size) for r in range(size)]
    idx = np.concatenate([p[1].astype(np.int64) for p in parts])
    vals = np.concatenate([p[0].astype(np.float64) for p in parts])
    uniq, inv = np.unique(idx, return_inverse=True)
    sums = np.zeros((uniq.shape[0], *vals.shape[1:]))
    mass = np.zeros_like(sums)
    np.add.at(sums, inv.reshape(-1), vals)
    np.add.at(mass, inv.reshape(-1), np.abs(vals))
    return uniq, sums, mass


def mismatch(result: SparseVector, case: Case, size: int) -> str | None:
    """Why ``result`` is not the exact sum of every rank's input (None when it is)."""
    ridx = np.asarray(result.indices).astype(np.int64)
    rval = np.asarray(result.values).astype(np.float64)
    if result.n != case.n:
        return f"n {result.n} != {case.n}"
    if str(result.values.dtype) != case.dtype:
        return f"dtype {result.values.dtype} != {case.dtype}"
    row = () if case.width is None else (case.width,)
    if tuple(result.values.shape) != (ridx.shape[0], *row):
        return f"values shape {tuple(result.values.shape)} for {ridx.shape[0]} indices, rows {row}"
    if ridx.shape[0] and (np.any(np.diff(ridx) <= 0) or ridx[0] < 0 or ridx[-1] >= case.n):
        return "indices not sorted, unique and in range"
    if result.indices.dtype != index_dtype(case.n):
        return f"index dtype {result.indices.dtype} != {index_dtype(case.n)}"
    oi, ov, oabs = oracle(case, size)
    stray = np.setdiff1d(ridx, oi)
    if stray.shape[0]:
        return f"index {stray[0]} is in no rank's input"
    union = np.union1d(ridx, oi)
    got = np.zeros((union.shape[0], *row))
    want = np.zeros_like(got)
    scale = np.zeros_like(got)
    got[np.searchsorted(union, ridx)] = rval
    pos = np.searchsorted(union, oi)
    want[pos] = ov
    scale[pos] = oabs
    eps = float(np.finfo(case.dtype).eps)
    # rounding of the inputs is shared; each partial sum adds at most one rounding
    tol = 4 * eps * (size + 2) * (scale + np.abs(want)) + 1e-30
    off = np.abs(got - want) > tol
    bad = np.flatnonzero(off.any(axis=1) if off.ndim == 2 else off)
    if bad.shape[0]:
        j = bad[0]
        return f"at index {union[j]}: got {got[j]!r}, want {want[j]!r} ({bad.shape[0]} differ)"
    return None


def digest(result: SparseVector) -> str:
    """A hash of the result's bytes, to check it is identical on every rank."""
    h = hashlib.sha256()
    h.update(np.asarray(result.indices).tobytes())
    h.update(np.asarray(result.values).tobytes())
    h.update(str(result.n).encode())
    return h.hexdigest()


class DLPackOnly:
    """A host array producer that offers DLPack alone (no buffer, no ``__array__``), as
    some libraries' arrays do."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def assert_all(comm, ok: bool, msg: str = "") -> None:
    """Collective assertion: every rank fails together, naming the ranks that failed."""
    flags = comm.allgather_object((bool(ok), msg))
    bad = [f"rank {r}: {m}" for r, (o, m) in enumerate(flags) if not o]
    assert not bad, "; ".join(bad)


def assert_identical(comm, result: SparseVector) -> None:
    d = comm.allgather_object(digest(result))
    assert_all(comm, all(x == d[0] for x in d), "result differs across ranks")
