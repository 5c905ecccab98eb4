"""The benchmarks' validation can fail: wrong results, registered under test-only names,
run through ``verify_all`` (in-process, one rank, with the inputs of several ranks)."""

from __future__ import annotations

import csv
import io

import numpy as np
import pytest

from sparsecoll.benchmarks.main import verify_all
from sparsecoll.benchmarks.problems import make_problem
from sparsecoll.comm import Communicator
from sparsecoll.sparse import SparseVector, coalesce


@pytest.fixture(scope="module")
def comm():
    return Communicator()


def ranks_inputs(n: int, density: float, size: int, dtype) -> list[SparseVector]:
    """Every rank's coalesced bench input, as the benchmarks gather them."""
    out = []
    for r in range(size):
        vals, idx = make_problem(n, density, r, size, "random", dtype)
        out.append(coalesce(idx, vals, n))
    return out


def sum_of(inputs: list[SparseVector], dtype) -> SparseVector:
    """The sum, built here (float64, rounded once), apart from the library."""
    n = inputs[0].n
    dense = np.zeros(n)
    for x in inputs:
        np.add.at(dense, x.indices.astype(np.int64), x.values.astype(np.float64))
    idx = np.unique(np.concatenate([x.indices for x in inputs]))
    return SparseVector(idx, dense[idx].astype(dtype), n)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("size", [2, 3, 8])
def test_dropping_small_entries_fails_an_exact_check(comm, dtype, size):
    """Each rank dropping its entries with |v| < 0.25 before an exact sum: the old tolerance
    (64·eps·(|ref| + max|ref|)) let it pass in float16 (6.25% of the largest |sum| per
    entry); the per-index one (P·eps·Σ_r|x_r[i]|) does not. The right sum passes."""
    n = 4096
    inputs = ranks_inputs(n, 0.05, size, dtype)
    reference = sum_of(inputs, dtype)
    dropped = [
        SparseVector(x.indices[np.abs(x.values) >= 0.25], x.values[np.abs(x.values) >= 0.25], n)
        for x in inputs
    ]
    wrong = sum_of(dropped, dtype)
    for name in ("allgather", "dsa", "dense"):
        assert verify_all(comm, name, reference, reference, inputs, n, 0)
        assert not verify_all(comm, name, wrong, reference, inputs, n, 0)


def test_one_small_term_missing_fails(comm):
    """An entry is not excused by the size of others: one sum off by its smallest term."""
    n, dtype = 64, np.float16
    a = SparseVector(np.array([1, 5]), np.array([1000.0, 0.5], dtype), n)
    b = SparseVector(np.array([5]), np.array([0.25], dtype), n)
    reference = sum_of([a, b], dtype)
    wrong = SparseVector(reference.indices, reference.values.copy(), n)
    wrong.values[1] = 0.5  # b's 0.25 lost at index 5
    assert verify_all(comm, "allgather", reference, reference, [a, b], n, 0)
    assert not verify_all(comm, "allgather", wrong, reference, [a, b], n, 0)


@pytest.fixture
def doubled_dense(monkeypatch):
    """The dense baseline made wrong: its sum doubled."""
    from sparsecoll.algorithms.dense import Dense

    reduce = Dense.reduce

    def wrong(self, comm, x):
        out = reduce(self, comm, x)
        return SparseVector(out.indices, out.values * 2, out.n)

    monkeypatch.setattr(Dense, "reduce", wrong)


def test_a_wrong_dense_baseline_fails_the_main_bench(doubled_dense, capsys):
    """The reference is the inputs' sum, not dense's result: before, dense was checked
    against itself ('sum ok') and the correct algorithms failed against it."""
    from sparsecoll.benchmarks import main

    rc = main.main(["-m", "2048", "--algorithm", "allgather,dsa", "-i", "1", "-x", "0"])
    rows = {line.split()[0]: line.split()[2] for line in capsys.readouterr().out.splitlines()}
    assert rc == 1
    assert (rows["dense"], rows["allgather"], rows["dsa"]) == ("FAIL", "ok", "ok")


def test_a_wrong_dense_baseline_fails_the_osu_bench(doubled_dense, capsys):
    from sparsecoll.benchmarks import osu

    argv = ["-m", "2048", "--algorithm", "dense,allgather", "-c", "-q", "--format", "csv"]
    argv += ["-i", "1", "-x", "0"]
    rc = osu.main(argv)
    rows = {
        r["algorithm"]: r["valid"] for r in csv.DictReader(io.StringIO(capsys.readouterr().out))
    }
    assert rc == 1
    assert rows == {"dense": "no", "allgather": "yes"}
