"""The OSU-style suite, run for real under mpiexec with tiny sizes and validation on."""

from __future__ import annotations

import csv
import io
import json

import pytest

from sparsecoll import available_algorithms
from sparsecoll._array import cupy_or_none
from sparsecoll.benchmarks.model import read_rows
from sparsecoll.benchmarks.osu import FIELDS, latency_stats, parse_algorithms, parse_sizes

from .mpirun import ROOT, run_mpi

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
        assert float(r["min_us"]) <= float(r["median_us"]) <= float(r["max_us"])
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
        assert lines[3].startswith("# Size: bytes of the dense vector (n x 4 B); Latency: ")
        assert "avg/min/max over the 2 timed calls" in lines[3]
        assert lines[4].startswith("# Speedup vs dense: dense Avg Latency / this Avg Latency")
        assert "Validation: against the dense sum" in lines[4]
        assert lines[5].split() == [
            "#",
            "Size",
            "n",
            "Avg",
            "Latency(us)",
            "Min",
            "Latency(us)",
            "Max",
            "Latency(us)",
            "Iterations",
            "Bytes/rank",
            "Speedup",
            "vs",
            "dense",
            "Validation",
        ]
        rows = [line.split() for line in lines[6:]]
        assert [int(r[1]) for r in rows] == [1024, 3000]  # n
        assert [int(r[0]) for r in rows] == [4 * 1024, 4 * 3000]  # Size: bytes, float32
        assert all(r[-1] == "Pass" for r in rows)
        assert all(r[5] == "2" for r in rows)  # iterations
        for r in rows:  # min <= avg <= max
            assert float(r[3]) <= float(r[2]) <= float(r[4])


@pytest.mark.mpi
def test_table_compares_algorithms_in_one_table() -> None:
    """--table: one OSU-style table, a row per size and per algorithm its avg latency and
    bytes per rank (the same figures as the CSV's), validation in the last column."""
    names = ["dsa", "oktopk", "dense"]
    base = [*OSU, *TINY, "--reuse", "--algorithm", ",".join(names)]
    proc = run_mpi(2, [*base, "--table"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("# sparsecoll OSU-style sparse allreduce latency test v")
    assert lines[1].startswith("# MPI library: ")
    assert "P: 2, algorithms: dsa, oktopk, dense, density: 0.01" in lines[2]
    assert lines[2].endswith("one instance reused per size")
    assert lines[3].startswith("# Size: bytes of the dense vector (n x 4 B); NAME(us): avg")
    cols = [f"{a}({unit})" for a in names for unit in ("us", "B")]
    assert lines[4].split() == ["#", "Size", "n", *cols, "Validation"]
    rows = [line.split() for line in lines[5:]]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(4096, 1024), (12000, 3000)]
    assert all(r[-1] == "Pass" for r in rows)
    assert all(float(r[2 + 2 * i]) > 0 for r in rows for i in range(len(names)))
    assert [int(r[7]) for r in rows] == [2 * 4 * 1024 // 2, 2 * 4 * 3000 // 2]  # dense(B)


@pytest.mark.mpi
def test_full_stats_come_from_the_same_samples() -> None:
    """The issue's case: with -f, median, avg, min and max are all over the same calls."""
    args = [*OSU, "-m", "64K:256K", "-i", "3", "-x", "1", "--format", "csv", "-f", "-q"]
    proc = run_mpi(3, [*args, "--algorithm", "all"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    rows = _csv(proc.stdout)
    assert len(rows) == 3 * len(available_algorithms())
    for r in rows:
        lo, hi = float(r["min_us"]), float(r["max_us"])
        assert lo <= float(r["median_us"]) <= hi, r
        assert lo <= float(r["avg_us"]) <= hi, r
        assert int(r["size_bytes"]) == 4 * int(r["n"])


def test_latency_stats_share_samples() -> None:
    stats = latency_stats([3e-6, 1e-6, 10e-6, 2e-6])
    assert stats == {"avg_us": 4.0, "min_us": 1.0, "max_us": 10.0, "median_us": 2.5}


def test_readers_take_old_and_new_csvs(tmp_path) -> None:
    """Older CSVs predate size_bytes; read_rows fills it in from n and dtype."""
    old = read_rows([str(ROOT / "tests" / "data" / "shm_p2.csv")])
    assert old
    assert all(r["size_bytes"] == 4 * r["n"] for r in old)
    row = dict.fromkeys(FIELDS, "")
    row.update(algorithm="dense", exact=True, P=2, n=1024, size_bytes=2048, dtype="float16")
    row.update(density=0.01, k=10, iterations=1, avg_us=1.0, min_us=1.0, max_us=1.0)
    row.update(median_us=1.0, bytes_per_rank=2048, bytes_recv_per_rank=2048, result_nnz=20)
    row.update(messages_per_rank=2, meta_bytes_per_rank=0, meta_messages_per_rank=0)
    path = tmp_path / "new.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerow(row)
    (new,) = read_rows([str(path)])
    assert new["size_bytes"] == 2048
    assert new["n"] == 1024


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


def test_wire_variants_are_named_but_not_in_all() -> None:
    """``dsa:compact`` runs dsa with wire="compact"; ``all`` keeps to the plain names."""
    from sparsecoll.benchmarks.cli import build, wire_variants

    known = wire_variants(["allgather", "dense", "dsa"])
    assert known == ["allgather", "allgather:compact", "dense", "dsa", "dsa:compact"]
    assert parse_algorithms(["all"], known) == ["allgather", "dense", "dsa"]
    assert parse_algorithms(["dsa:compact,dsa"], known) == ["dsa:compact", "dsa"]
    with pytest.raises(ValueError, match="unknown algorithm 'dense:compact'"):
        parse_algorithms(["dense:compact"], known)
    assert build("dsa:compact", 1000, 10).wire == "compact"
    assert build("dsa", 1000, 10).wire == "raw"


def test_readme_headline_says_what_it_measures() -> None:
    """The README's headline speed-up is the collective alone on reused, pre-made input:
    it must say so beside the number, not leave it to be read as a training speed-up."""
    text = " ".join((ROOT / "README.md").read_text().split())
    at = text.index("35.7×")
    around = text[at - 300 : at + 800]
    for needed in ("collective alone", "already sparse", "--reuse", "not a training-step"):
        assert needed in around, needed


@pytest.mark.mpi
def test_skewed_patterns_run_and_validate() -> None:
    """hot, zipf and tokens inputs through the suite (auto too: it reads their skew)."""
    for overlap in ("hot", "zipf", "tokens"):
        args = [*OSU, "-m", "4K", "-i", "1", "-x", "0", "-c", "-q", "--format", "json"]
        args += ["--overlap", overlap, "--algorithm", "dsa,auto"]
        proc = run_mpi(2, args, timeout=300)
        assert proc.returncode == 0, proc.stdout[-6000:]
        doc = json.loads(proc.stdout)
        assert doc["header"]["overlap"] == overlap
        assert [r["valid"] for r in doc["results"]] == ["yes", "yes"], overlap
