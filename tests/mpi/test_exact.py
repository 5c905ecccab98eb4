"""Exact algorithms equal the dense sum of every rank's input (property-based, under MPI)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given, settings

import sparsecoll
from sparsecoll.algorithms.base import reference_sum
from sparsecoll.benchmarks.problems import make_problem
from sparsecoll.registry import algorithm_class
from sparsecoll.sparse import coalesce

from .cases import KINDS, assert_all, assert_identical, cases, digest, local_input, mismatch

EXACT = [a for a in sparsecoll.available_algorithms() if algorithm_class(a).exact]


@pytest.mark.parametrize("name", EXACT)
@given(case=cases(kinds=(*KINDS, "cancel")))
def test_equals_dense_sum(comm, name, case):
    """(``cancel``: sums that are exactly 0, explicit zeros and -0.0 in the input; a zero
    may be kept or dropped, but no index outside the inputs may appear.)"""
    if algorithm_class(name).densifies and case.huge:
        return
    vals, idx = local_input(case, comm.rank, comm.size)
    out = sparsecoll.allreduce(comm.mpi_comm, vals, idx, n=case.n, algorithm=name)
    why = mismatch(out, case, comm.size)
    assert_all(comm, why is None, str(why))
    assert_identical(comm, out)
    # the result never shares memory with the input (docs/guide/algorithms.md): P = 1 included
    shared = np.shares_memory(out.values, vals) or np.shares_memory(out.indices, idx)
    assert_all(comm, not shared, "the result shares memory with the input")
    # the input arrays are not modified
    vals2, idx2 = local_input(case, comm.rank, comm.size)
    assert_all(comm, (vals2 == vals).all() and (idx2 == idx).all(), "input modified")


ROW_EXACT = [a for a in EXACT if algorithm_class(a).takes_rows]


@pytest.mark.parametrize("name", ROW_EXACT)
@settings(max_examples=max(4, settings().max_examples // 3))
@given(case=cases(kinds=(*KINDS, "cancel"), rows=True))
def test_rows_equal_dense_sum(comm, name, case):
    """Row values (an index per row of D values, D in 1, 3, 16): the dense ``(n, D)`` sum,
    rows in the result's width, identical on every rank, the input untouched."""
    if algorithm_class(name).densifies and case.huge:
        return
    vals, idx = local_input(case, comm.rank, comm.size)
    out = sparsecoll.allreduce(comm.mpi_comm, vals, idx, n=case.n, algorithm=name)
    why = mismatch(out, case, comm.size)
    assert_all(comm, why is None, f"{why} ({case})")
    assert_all(comm, out.width == case.width, f"width {out.width} != {case.width}")
    assert_identical(comm, out)
    vals2, idx2 = local_input(case, comm.rank, comm.size)
    assert_all(comm, (vals2 == vals).all() and (idx2 == idx).all(), "input modified")
    # what the benchmarks check passes too, rows and all
    inputs = [coalesce(*local_input(case, r, comm.size)[::-1], case.n) for r in range(comm.size)]
    ok = algorithm_class(name)().verify(out, reference_sum(inputs), inputs)
    assert_all(comm, ok, f"{name}: verify refused an exact result ({case})")


@functools.cache
def _large_case(size: int, overlap: str):
    """Every rank's input of the large-message case, coalesced, and their reference sum."""
    n = 1 << 20
    inputs = [
        coalesce(*make_problem(n, 0.01, r, size, overlap, "float32", seed=3)[::-1], n)
        for r in range(size)
    ]
    return inputs, reference_sum(inputs)


@pytest.mark.parametrize("name", EXACT)
@pytest.mark.parametrize("overlap", ["random", "skewed"])
def test_large_messages_equal_dense_sum(comm, name, overlap):
    """About 10k pairs a rank, so messages run past 64 KiB (recursive_doubling's
    PACK_LIMIT, where its pairs travel as two messages) up to hundreds of KiB."""
    inputs, want = _large_case(comm.size, overlap)
    mine = inputs[comm.rank]
    out = sparsecoll.allreduce(comm, mine.values, mine.indices, n=mine.n, algorithm=name)
    assert_identical(comm, out)
    ok = algorithm_class(name)().verify(out, want, inputs)
    assert_all(comm, ok, f"{name}: not the exact sum ({overlap})")


def spread_input(case, rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """``local_input`` with magnitudes spread over 2^-12 .. 2^8 (float16's whole precision
    in play: large terms round the small ones away in partial sums, then cancel)."""
    vals, idx = local_input(case, rank, size)
    rng = np.random.default_rng([case.seed, rank, 7])
    scale = np.exp2(rng.integers(-12, 9, size=vals.shape[0]))
    return (vals.astype(np.float64) * scale).astype(vals.dtype), idx


@pytest.mark.parametrize("name", EXACT)
@given(case=cases(kinds=("random", "same", "repeated", "skewed", "one_dense"), max_n=100_000))
def test_verify_accepts_exact_results(comm, name, case):
    """What the benchmarks check (``verify`` against :func:`reference_sum`, the tolerance
    per index from the inputs) passes every exact algorithm, on inputs whose partial sums
    round the most (float16 multi-hop sums in dsa, recursive_doubling)."""
    inputs = [coalesce(*spread_input(case, r, comm.size)[::-1], case.n) for r in range(comm.size)]
    vals, idx = spread_input(case, comm.rank, comm.size)
    out = sparsecoll.allreduce(comm.mpi_comm, vals, idx, n=case.n, algorithm=name)
    ok = algorithm_class(name)().verify(out, reference_sum(inputs), inputs)
    assert_all(comm, ok, f"{name}: verify refused an exact result ({case})")


@pytest.mark.parametrize("layout", ["strided", "readonly"])
@pytest.mark.parametrize("name", sparsecoll.available_algorithms())
@given(case=cases(max_n=100_000))
def test_strided_and_readonly_inputs(comm, name, layout, case):
    """Views as numpy makes them (``x[::2]``, a read-only buffer) give the same result as
    contiguous copies, for every algorithm (oktopk once raised on a strided sorted input:
    its message packing viewed the values' bytes)."""
    cls = algorithm_class(name)
    opts = {} if cls.exact else cls.default_options(case.n, 20)
    vals, idx = local_input(case, comm.rank, comm.size)
    order = np.argsort(idx, kind="stable")  # sorted input keeps the caller's arrays
    vals, idx = vals[order], idx[order]
    if layout == "strided":
        v, i = np.repeat(vals, 2)[::2], np.repeat(idx, 2)[::2]
    else:
        v, i = np.frombuffer(vals.tobytes(), vals.dtype), np.frombuffer(idx.tobytes(), idx.dtype)
    want = sparsecoll.allreduce(comm, vals, idx, n=case.n, algorithm=name, **opts)
    got = sparsecoll.allreduce(comm, v, i, n=case.n, algorithm=name, **opts)
    same = digest(got) == digest(want)
    assert_all(comm, same, f"{name} {layout}: {got.nnz} entries vs {want.nnz}")


@pytest.mark.parametrize("name", sparsecoll.available_algorithms())
@pytest.mark.parametrize("n", [2**62 + 1, 2**63 - 1])
def test_n_up_to_int64_max(comm, name, n):
    """The largest lengths int64 indices allow: n * P overflows int64, so the ranges' bounds
    must not be computed as n * i (dsa once allocated a negative length)."""
    cls = algorithm_class(name)
    if cls.densifies:
        return
    opts = {} if cls.exact else cls.default_options(n, 4)
    idx = np.array([0, n - 1 - comm.rank, n - 1], np.int64)
    vals = np.array([1.0, 2.0, 4.0], np.float32)
    out = sparsecoll.allreduce(comm, vals, idx, n=n, algorithm=name, **opts)
    got = dict(zip(np.asarray(out.indices).tolist(), np.asarray(out.values).tolist()))
    p = comm.size
    want = {0: p, n - 1: 4 * p + 2}  # (rank 0 repeats n - 1)
    want.update({n - 1 - r: 2.0 for r in range(1, p)})
    ok = out.n == n and all(got.get(i, v) == v for i, v in want.items())
    if cls.exact:
        ok = ok and got == want
    assert_all(comm, ok, f"{name} n={n}: {got} vs {want}")
