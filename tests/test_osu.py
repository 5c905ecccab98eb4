"""The OSU-style suite, run for real under mpiexec with tiny sizes and validation on."""

from __future__ import annotations

import csv
import io
import json

import pytest

from sparsecoll import available_algorithms
from sparsecoll._array import cupy_or_none
from sparsecoll.benchmarks.osu import FIELDS, parse_algorithms, parse_sizes

from .mpirun import run_mpi

OSU = ["-m", "sparsecoll", "bench", "osu"]
TINY = ["-m", "1K,3000", "-i", "2", "-x", "1", "-c", "-q"]


def _csv(stdout: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(stdout)))


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 3, 4])
def test_every_algorithm_validates(nprocs: int) -> None:
    args = [*OSU, "-m", "3000", "-i", "2", "-x", "1", "-c", "-q", "--format", "csv"]
    proc = run_mpi(nprocs, args, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    rows = _csv(proc.stdout)
    assert list(rows[0]) == list(FIELDS)
    names = available_algorithms()
    assert sorted({r["algorithm"] for r in rows}) == names
    assert len(rows) == len(names)
    for r in rows:
        assert r["error"] == "", r
        assert r["valid"] == "yes", r
        assert int(r["P"]) == nprocs
        assert float(r["min_us"]) <= float(r["avg_us"]) <= float(r["max_us"])
        if nprocs == 1:
            assert int(r["bytes_per_rank"]) == 0, r
    for r in rows:
        if r["algorithm"] == "dense":  # exact: 2 (P-1)/P of the float32 buffer
            n = int(r["n"])
            assert int(r["bytes_per_rank"]) == 2 * (nprocs - 1) * 4 * n // nprocs
            assert r["speedup_vs_dense"] in ("1.0", "")


@pytest.mark.mpi
def test_text_output_has_osu_shape() -> None:
    proc = run_mpi(2, [*OSU, *TINY, "-f", "--algorithm", "allgather,dense"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    blocks = [b for b in proc.stdout.strip().split("\n\n") if b.strip()]
    assert len(blocks) == 2
    for block, name in zip(blocks, ["allgather", "dense"]):
        lines = block.splitlines()
        assert lines[0].startswith("# sparsecoll OSU-style sparse allreduce latency test v")
        assert lines[1].startswith("# MPI library: ")
        assert f"P: 2, algorithm: {name} (exact), density: 0.01" in lines[2]
        assert lines[3].split() == [
            "#",
            "Size",
            "Avg",
            "Latency(us)",
            "Min",
            "Latency(us)",
            "Max",
            "Latency(us)",
            "Iterations",
            "Bytes/rank",
            "vs",
            "dense",
            "Validation",
        ]
        sizes = [int(line.split()[0]) for line in lines[4:]]
        assert sizes == [1024, 3000]
        assert all(line.split()[-1] == "Pass" for line in lines[4:])
        assert all(line.split()[4] == "2" for line in lines[4:])  # iterations


@pytest.mark.mpi
def test_json_and_overlap_and_dtype() -> None:
    args = [
        *OSU,
        "-m",
        "2K",
        "-i",
        "1",
        "-x",
        "0",
        "-c",
        "-q",
        "--format",
        "json",
        "--overlap",
        "disjoint",
        "--dtype",
        "float64",
        "--algorithm",
        "allgather",
    ]
    proc = run_mpi(3, args, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    doc = json.loads(proc.stdout)
    assert doc["header"]["P"] == 3
    assert doc["header"]["overlap"] == "disjoint"
    (row,) = doc["results"]
    assert row["algorithm"] == "allgather"
    assert row["valid"] == "yes"
    # disjoint inputs: every rank receives the other two ranks' 20 pairs of int32 + float64
    assert row["result_nnz"] == 3 * 20
    assert row["bytes_per_rank"] == 2 * 20 * 12


@pytest.mark.mpi
@pytest.mark.skipif(cupy_or_none() is not None, reason="a GPU is present")
def test_cuda_without_gpu_fails_clearly() -> None:
    proc = run_mpi(2, [*OSU, "-m", "1K", "-d", "cuda", "-q"], timeout=120)
    assert proc.returncode == 2
    assert "-d cuda needs CuPy and a CUDA device" in proc.stdout
    assert proc.stdout.count("needs CuPy") == 1  # only rank 0 prints


@pytest.mark.mpi
def test_bad_algorithm_is_a_usage_error_on_every_rank() -> None:
    proc = run_mpi(2, [*OSU, "--algorithm", "nosuch"], timeout=120)
    assert proc.returncode == 2
    assert proc.stdout.count("unknown algorithm 'nosuch'") == 1


def test_parse_sizes() -> None:
    assert parse_sizes("1K:8K") == [1024, 2048, 4096, 8192]
    assert parse_sizes("1M:3M") == [2**20, 2**21]
    assert parse_sizes("25557032") == [25557032]
    assert parse_sizes("1k,5,2G") == [1024, 5, 2**31]
    for bad in ("8K:1K", "0", "x", "1T", "1:"):
        with pytest.raises(ValueError):
            parse_sizes(bad)


def test_parse_algorithms() -> None:
    known = ["allgather", "dense", "rabenseifner"]
    assert parse_algorithms(None, known) == known
    assert parse_algorithms(["all"], known) == known
    assert parse_algorithms(["dense,allgather", "dense"], known) == ["dense", "allgather"]
    with pytest.raises(ValueError, match="unknown algorithm 'x'"):
        parse_algorithms(["allgather,x"], known)
