"""Inputs in the representations numpy and torch users hold (non-native byte order, any
integer index type, lists, buffers, views, torch tensors), each rank its own: the result
equals that of plain native arrays, bit for bit, for every algorithm."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sparsecoll
from sparsecoll.registry import algorithm_class

from .cases import DLPackOnly, assert_all, cases, digest, local_input

try:
    import torch
except ImportError:  # (alike on every rank: a rank that skipped alone would leave a hang)
    torch = None

LAYOUTS = (
    "native",
    "big_endian",
    "narrow_index",
    "uint64_index",
    "list_index",
    "memoryview",
    "fortran_column",
    "negative_stride",
    "masked_without_mask",
    "dlpack_only",
    *(["torch"] if torch is not None else []),
)


def represent(layout: str, vals: np.ndarray, idx: np.ndarray, n: int):
    """(values, indices) holding the same numbers as ``vals``, ``idx`` in ``layout``."""
    if layout == "big_endian":
        return vals.astype(vals.dtype.newbyteorder(">")), idx.astype(">i8")
    if layout == "narrow_index":
        itype = next(t for t in (np.uint8, np.int16, np.uint32, np.int64) if n <= np.iinfo(t).max)
        return vals, idx.astype(itype)
    if layout == "uint64_index":
        return vals, idx.astype(np.uint64)
    if layout == "list_index":
        return vals, idx.tolist()
    if layout == "memoryview":
        return memoryview(vals), memoryview(idx)
    if layout == "fortran_column":  # a column of an (m, 2) Fortran array: contiguous
        return np.asfortranarray(np.stack([vals, vals], axis=1))[:, 1], idx
    if layout == "negative_stride":
        return vals[::-1].copy()[::-1], idx[::-1].copy()[::-1]
    if layout == "masked_without_mask":
        return np.ma.masked_array(vals, mask=False), np.ma.masked_array(idx)
    if layout == "dlpack_only":  # (was "values must be 1-D, got shape ()")
        return DLPackOnly(vals), DLPackOnly(idx)
    if layout == "torch":
        return torch.from_numpy(vals.copy()).requires_grad_(False), torch.from_numpy(idx.copy())
    return vals, idx


@pytest.mark.parametrize("name", sparsecoll.available_algorithms())
@given(case=cases(max_n=100_000), layouts=st.lists(st.sampled_from(LAYOUTS), min_size=8))
def test_representations_equal_native_arrays(comm, name, case, layouts):
    """Rank r passes its input as ``layouts[r]``: a big-endian rank among little-endian
    ones, uint64 indices, a list, a torch tensor; the result equals the native call's
    (big-endian values were refused as "not float32" before, a misleading TypeError)."""
    cls = algorithm_class(name)
    opts = {} if cls.exact else cls.default_options(case.n, 20)
    vals, idx = local_input(case, comm.rank, comm.size)
    layout = layouts[comm.rank % len(layouts)]
    v, i = represent(layout, vals, idx, case.n)
    want = sparsecoll.allreduce(comm, vals, idx, n=case.n, algorithm=name, **opts)
    got = sparsecoll.allreduce(comm, v, i, n=case.n, algorithm=name, **opts)
    same = digest(got) == digest(want)  # (the same bytes: native order, the same dtype)
    if layout == "torch":
        same = same and type(got.values).__name__ == "Tensor"
    assert_all(comm, same, f"{name} {layout}: {got!r} vs {want!r}")


@pytest.mark.parametrize("name", sparsecoll.available_algorithms())
def test_results_own_their_arrays(comm, name):
    """Input already coalesced (sorted, unique, int32, contiguous, read-only) on every rank:
    the result shares no memory with it and is writable (docs/guide/api.md, Ownership)."""
    cls = algorithm_class(name)
    opts = {} if cls.exact else cls.default_options(100, 10)
    idx = np.arange(comm.rank, 100, 7, dtype=np.int32)
    vals = np.linspace(1.0, 2.0, idx.shape[0])
    idx.flags.writeable = vals.flags.writeable = False
    out = sparsecoll.allreduce(comm, vals, idx, n=100, algorithm=name, **opts)
    shared = np.shares_memory(out.values, vals) or np.shares_memory(out.indices, idx)
    writable = out.values.flags.writeable and out.indices.flags.writeable
    assert_all(comm, not shared and writable, f"{name}: shared {shared}, writable {writable}")


@pytest.mark.parametrize("name", sparsecoll.available_algorithms())
def test_ranges_as_indices_with_an_empty_one(comm, name):
    """Each rank passes its slice of [0, n) as a range, the last one's empty (range(n, n)):
    numpy makes an empty range float64, which was refused on every rank as "indices must be
    integers, got float64 on rank P-1"; the result is that of int64 arrays."""
    cls = algorithm_class(name)
    opts = {} if cls.exact else cls.default_options(40, 40)
    n = 4 * comm.size
    lo = n if comm.rank == comm.size - 1 else 4 * comm.rank  # (the last slice empty)
    vals = np.arange(1.0, 1.0 + n - lo, dtype=np.float32)
    got = sparsecoll.allreduce(comm, vals, range(lo, n), n=n, algorithm=name, **opts)
    idx = np.arange(lo, n, dtype=np.int64)
    want = sparsecoll.allreduce(comm, vals, idx, n=n, algorithm=name, **opts)
    assert_all(comm, digest(got) == digest(want), f"{name}: {got!r} vs {want!r}")


ROW_ALGORITHMS = [a for a in sparsecoll.available_algorithms() if algorithm_class(a).takes_rows]


@pytest.mark.parametrize("name", ROW_ALGORITHMS)
@settings(max_examples=max(4, settings().max_examples // 3))
@given(case=cases(max_n=100_000, rows=True), layouts=st.lists(st.sampled_from(LAYOUTS), min_size=8))
def test_row_representations_equal_native_arrays(comm, name, case, layouts):
    """Row values (nnz, D) in each representation (a Fortran-order array for the column
    layout, a torch tensor, DLPack alone): the native call's result, bit for bit."""
    vals, idx = local_input(case, comm.rank, comm.size)
    layout = layouts[comm.rank % len(layouts)]
    if layout == "fortran_column":
        v, i = np.asfortranarray(vals), idx
    else:
        v, i = represent(layout, vals, idx, case.n)
    want = sparsecoll.allreduce(comm, vals, idx, n=case.n, algorithm=name)
    got = sparsecoll.allreduce(comm, v, i, n=case.n, algorithm=name)
    same = digest(got) == digest(want) and got.width == case.width
    if layout == "torch":
        same = same and type(got.values).__name__ == "Tensor"
    assert_all(comm, same, f"{name} {layout}: {got!r} vs {want!r}")
