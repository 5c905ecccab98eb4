"""Torch sparse COO tensors as sparsecoll's COO and back.

A hybrid tensor (dense dimensions after the sparse ones: an embedding's gradient has one of
each) becomes row values: one index per row (its sparse dimensions raveled), a row of ``D``
values (its dense dimensions raveled), so the index travels once per row. For an algorithm
that takes 1-D values only (``as_rows=False``) the row ``r`` becomes the scalar indices
``r·D .. r·D + D - 1``, and :func:`from_coo` fills out each row that holds an entry with
zeros. :func:`from_coo` builds the coalesced tensor of the same layout from a reduced (sorted,
unique) COO. This is the only module that knows the layout.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._group import torch_module

__all__ = ["check_coo", "from_coo", "to_coo"]

_INT64_MAX = 2**63 - 1


def _dense_width(t: Any) -> int:
    return math.prod(t.shape[t.sparse_dim() :])


def check_coo(t: Any) -> None:
    """Raise ValueError for a sparse tensor that :func:`to_coo` cannot take: no sparse
    dimension, or more than 2**63 - 1 entries."""
    n = math.prod(t.shape)
    if t.sparse_dim() == 0:
        raise ValueError(f"a sparse tensor with no sparse dimension (shape {tuple(t.shape)})")
    if n > _INT64_MAX:
        raise ValueError(f"a sparse tensor of {n} entries (at most 2**63 - 1)")


def to_coo(t: Any, as_rows: bool = True) -> tuple[np.ndarray, np.ndarray, int]:
    """``t``'s (values, indices, n) on the host: values in ``t``'s dtype (bfloat16 widened to
    float32), indices int64 in ``[0, n)``. A hybrid tensor gives rows (values of shape
    (nnz, D), n the number of rows) or, with ``as_rows=False``, scalar COO (n = ``t.numel()``).
    Repeated indices stay repeated (the reduction sums them). Raises as
    :func:`check_coo`."""
    torch = torch_module()
    check_coo(t)
    n = math.prod(t.shape)
    t = t.detach().cpu()
    width = _dense_width(t)
    rows = t._indices().numpy()
    rows = np.ravel_multi_index(tuple(rows), tuple(t.shape[: t.sparse_dim()]))
    vals = t._values()
    if vals.dtype == torch.bfloat16:
        vals = vals.float()
    if width > 1 and as_rows:
        values = np.ascontiguousarray(vals.numpy().reshape(-1, width))
        return values, rows.astype(np.int64, copy=False), n // width
    values = np.ascontiguousarray(vals.numpy().reshape(-1))
    if width == 1:
        return values, rows.astype(np.int64, copy=False), n
    indices = (rows.astype(np.int64)[:, None] * width + np.arange(width)).reshape(-1)
    return values, indices, n


def from_coo(values: Any, indices: Any, like: Any) -> Any:
    """The coalesced sparse tensor of ``like``'s shape, dtype and sparse/dense dimensions
    holding the COO, rows or scalar (``indices`` sorted and unique, as a reduction returns
    them)."""
    torch = torch_module()
    values, indices = np.asarray(values), np.asarray(indices, dtype=np.int64)
    sd = like.sparse_dim()
    sparse_shape, dense_shape = tuple(like.shape[:sd]), tuple(like.shape[sd:])
    width = _dense_width(like)
    if width == 1 or values.ndim == 2:
        rows, block = indices, values
    else:
        flat_rows, cols = np.divmod(indices, width)
        rows, where = np.unique(flat_rows, return_inverse=True)
        block = np.zeros((rows.size, width), dtype=values.dtype)
        block[where, cols] = values
    index = np.stack(np.unravel_index(rows, sparse_shape)) if rows.size else np.zeros((sd, 0))
    return torch.sparse_coo_tensor(
        torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64)),
        torch.from_numpy(np.ascontiguousarray(block).reshape(rows.size, *dense_shape)).to(
            like.dtype
        ),
        tuple(like.shape),
        is_coalesced=True,
        check_invariants=False,  # (sorted unique in-range indices, as reductions return)
    )
