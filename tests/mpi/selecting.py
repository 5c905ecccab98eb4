"""Inputs and oracles shared by the selecting-algorithm tests (gtopk, oktopk).

Every rank can rebuild every rank's input from the drawn case, so the oracles need no
communication. ``integral`` inputs have small integer values: every sum is exact in every
dtype (float16 included), so exact top-k sets and ties can be checked bit for bit.
"""

from __future__ import annotations

import numpy as np

from sparsecoll import SparseVector
from sparsecoll.sparse import coalesce

from .cases import Case, digest, local_input


def rank_input(case: Case, rank: int, size: int, integral: bool = False) -> SparseVector:
    """This rank's coalesced input; with ``integral``, values rounded into [-8, 8]."""
    vals, idx = local_input(case, rank, size)
    x = coalesce(idx, vals, case.n)
    if integral:
        x = SparseVector(x.indices, np.clip(np.rint(x.values * 2), -8, 8).astype(case.dtype), x.n)
    return x


def all_inputs(case: Case, size: int, integral: bool = False) -> list[SparseVector]:
    return [rank_input(case, r, size, integral) for r in range(size)]


def dense_sum(inputs: list[SparseVector]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted indices, float64 sums, sums of |contributions|) of the nonzero entries of the
    exact sum, kept sparse (huge n works)."""
    idx = np.concatenate([x.indices.astype(np.int64) for x in inputs])
    vals = np.concatenate([x.values.astype(np.float64) for x in inputs])
    uniq, inv = np.unique(idx, return_inverse=True)
    sums = np.bincount(inv, vals, uniq.shape[0])
    scale = np.bincount(inv, np.abs(vals), uniq.shape[0])
    nz = sums != 0
    return uniq[nz], sums[nz], scale[nz]


def exact_topk(idx: np.ndarray, vals: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest |vals| (nonzero only), ties by lower index, sorted."""
    order = np.lexsort((idx, -np.abs(vals)))
    return np.sort(idx[order[:k]])


def well_formed(out: SparseVector, n: int, dtype: str, most: int) -> str | None:
    """Why ``out`` breaks the shape rules of a selecting result (None when it does not)."""
    from sparsecoll._array import index_dtype

    ri = np.asarray(out.indices).astype(np.int64)
    if out.n != n:
        return f"n {out.n} != {n}"
    if str(out.values.dtype) != dtype:
        return f"dtype {out.values.dtype} != {dtype}"
    if out.indices.dtype != index_dtype(n):
        return f"index dtype {out.indices.dtype} != {index_dtype(n)}"
    if ri.shape[0] and (np.any(np.diff(ri) <= 0) or ri[0] < 0 or ri[-1] >= n):
        return "indices not sorted, unique and in range"
    if ri.shape[0] > most:
        return f"{ri.shape[0]} entries, at most {most} allowed"
    if out.contributed is None or out.local is None:
        return "contributed/local not set"
    if out.contributed.shape[0] != out.local.nnz or out.contributed.dtype != bool:
        return "contributed is not a boolean mask over the local input"
    return None


def conservation(
    out: SparseVector, inputs: list[SparseVector], masks: list[np.ndarray]
) -> str | None:
    """Error feedback loses nothing: result + every rank's residual == sum of inputs.

    The residual of rank r is its input without the entries its mask says reached the
    result; checked in float64 with a tolerance for the rounding of partial sums.
    """
    parts_i = [out.indices.astype(np.int64)]
    parts_v = [out.values.astype(np.float64)]
    scale_v = [np.zeros(out.nnz)]
    for x, m in zip(inputs, masks):
        parts_i += [x.indices[~m].astype(np.int64), x.indices.astype(np.int64)]
        parts_v += [x.values[~m].astype(np.float64), -x.values.astype(np.float64)]
        scale_v.append(np.zeros(int((~m).sum())))
        scale_v.append(np.abs(x.values.astype(np.float64)))
    idx = np.concatenate(parts_i)
    uniq, inv = np.unique(idx, return_inverse=True)
    diff = np.bincount(inv, np.concatenate(parts_v), uniq.shape[0])
    scale = np.bincount(inv, np.concatenate(scale_v), uniq.shape[0])
    eps = float(np.finfo(out.values.dtype).eps)
    bad = np.flatnonzero(np.abs(diff) > 4 * eps * (len(inputs) + 2) * scale + 1e-30)
    if bad.shape[0]:
        j = bad[0]
        return f"at index {uniq[j]}: result + residuals - inputs = {diff[j]!r}"
    return None


def verdict(comm, why: str | None, out: SparseVector) -> None:
    """One collective check: no rank found a problem and the result is identical on all."""
    every = comm.allgather_object((why, digest(out)))
    bad = [f"rank {r}: {w}" for r, (w, _) in enumerate(every) if w is not None]
    if not bad and any(d != every[0][1] for _, d in every):
        bad = ["result differs across ranks"]
    assert not bad, "; ".join(bad)
