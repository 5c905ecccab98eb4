"""Torch sparse COO tensors as sparsecoll's scalar COO and back.

:func:`to_coo` flattens a tensor of any sparse and dense dimensions into one entry per
scalar: a hybrid tensor's row ``r`` of ``D`` values (sparse_dim=1, dense_dim=1: an
embedding's gradient) becomes the indices ``r·D .. r·D + D - 1``. :func:`from_coo` builds
the tensor of the same layout from a reduced (sorted, unique) scalar COO: coalesced, every
row that holds an entry filled out with zeros. The two are inverse on coalesced input up to
those zeros; this is the only module that knows the layout.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._group import torch_module

__all__ = ["from_coo", "to_coo"]

_INT64_MAX = 2**63 - 1


def _dense_width(t: Any) -> int:
    return math.prod(t.shape[t.sparse_dim() :])


def to_coo(t: Any) -> tuple[np.ndarray, np.ndarray, int]:
    """``t``'s (values, indices, n) as scalar COO on the host: values in ``t``'s dtype
    (bfloat16 widened to float32), indices int64 in ``[0, n)``, n = ``t.numel()``.
    Repeated indices stay repeated (the reduction sums them). Raises ValueError for a
    tensor with no sparse dimension or more than 2**63 - 1 entries."""
    torch = torch_module()
    n = math.prod(t.shape)
    if t.sparse_dim() == 0:
        raise ValueError(f"a sparse tensor with no sparse dimension (shape {tuple(t.shape)})")
    if n > _INT64_MAX:
        raise ValueError(f"a sparse tensor of {n} entries (at most 2**63 - 1)")
    t = t.detach().cpu()
    width = _dense_width(t)
    rows = t._indices().numpy()
    rows = np.ravel_multi_index(tuple(rows), tuple(t.shape[: t.sparse_dim()]))
    vals = t._values()
    if vals.dtype == torch.bfloat16:
        vals = vals.float()
    values = np.ascontiguousarray(vals.numpy().reshape(-1))
    if width == 1:
        return values, rows.astype(np.int64, copy=False), n
    indices = (rows.astype(np.int64)[:, None] * width + np.arange(width)).reshape(-1)
    return values, indices, n


def from_coo(values: Any, indices: Any, like: Any) -> Any:
    """The coalesced sparse tensor of ``like``'s shape, dtype and sparse/dense dimensions
    holding the scalar COO (``indices`` sorted and unique, as a reduction returns them)."""
    torch = torch_module()
    values, indices = np.asarray(values), np.asarray(indices, dtype=np.int64)
    sd = like.sparse_dim()
    sparse_shape, dense_shape = tuple(like.shape[:sd]), tuple(like.shape[sd:])
    width = _dense_width(like)
    if width == 1:
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
