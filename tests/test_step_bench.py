"""bench/step.py (the training-step benchmark) runs under mpiexec and reports every step."""

from __future__ import annotations

import csv

import pytest

from .mpirun import ROOT, run_mpi


@pytest.mark.mpi
def test_step_benchmark_runs(tmp_path) -> None:
    out = tmp_path / "step.csv"
    proc = run_mpi(
        3,
        [str(ROOT / "bench" / "step.py"), "-m", "64K", "-i", "3", "-x", "1", "--csv", str(out)],
        timeout=600,
        env={"SPARSECOLL_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = list(csv.DictReader(out.open()))
    algorithms = ("dense", "allgather", "gtopk", "oktopk", "exdyna")
    assert [r["algorithm"] for r in rows] == [a for a in algorithms for _ in range(3)]
    for r in rows:
        assert r["P"] == "3" and r["n"] == str(64 * 1024)
        assert 0 <= float(r["local_s"]) <= float(r["time_s"])
        assert int(r["faults"]) >= 0
        assert int(r["full_topk"]) in (0, 1)
        assert float(r["add_s"]) > 0
        if r["algorithm"] in ("gtopk", "oktopk"):
            assert r["nnz"] == r["k"]  # exactly k kept (oktopk: window or exact calls)
    header = [ln for ln in proc.stdout.splitlines() if ln.startswith("algorithm")]
    assert len(header) == 1 and "x add" in header[0] and "add ms" in header[0]
    assert header[0].split()[-2:] == ["faults", "full"]


@pytest.mark.mpi
def test_step_benchmark_fresh_stream(tmp_path) -> None:
    """--stream fresh: a new gradient every step (shifted, scaled bases), the same steps in
    every algorithm's run; exactly k kept where the algorithm promises it."""
    out = tmp_path / "fresh.csv"
    args = ["-m", "64K", "--stream", "fresh", "--grads", "1", "-i", "3", "-x", "2"]
    proc = run_mpi(
        2,
        [str(ROOT / "bench" / "step.py"), *args, "--algorithms", "gtopk,oktopk", "--csv", str(out)],
        timeout=600,
        env={"SPARSECOLL_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = list(csv.DictReader(out.open()))
    assert [r["algorithm"] for r in rows] == ["gtopk"] * 3 + ["oktopk"] * 3
    assert all(r["nnz"] == r["k"] for r in rows)
    assert "stream fresh" in proc.stdout


@pytest.mark.mpi
def test_step_benchmark_embedding_rows(tmp_path) -> None:
    """--rows: fewer than k nonzeros per step in all (3 ranks x 2 rows of 256 < 1% of 256K),
    so every selecting algorithm keeps fewer than k (what stays in a residual adds some)."""
    out = tmp_path / "rows.csv"
    args = ["-m", "256K", "--rows", "2", "-i", "3", "-x", "1", "--csv", str(out)]
    proc = run_mpi(
        3,
        [str(ROOT / "bench" / "step.py"), *args, "--algorithms", "allgather,oktopk,exdyna"],
        timeout=600,
        env={"SPARSECOLL_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 9
    for r in rows:
        assert 0 < int(r["nnz"]) < int(r["k"]) == round(0.01 * 256 * 1024), r


@pytest.mark.mpi
@pytest.mark.parametrize("option", ["--csv", "--plot"])
def test_step_benchmark_refuses_an_output_it_cannot_write(tmp_path, option: str) -> None:
    """An output in a missing folder used to fail after the whole run (a FileNotFoundError
    traceback once every step had run): now every rank stops before the first step."""
    out = tmp_path / "missing" / "out"
    args = [str(ROOT / "bench" / "step.py"), "-m", "4K", "-i", "1", "-x", "0", option, str(out)]
    proc = run_mpi(2, args, timeout=300, env={"SPARSECOLL_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stdout[-4000:]
    assert proc.stdout.count(f"error: cannot write {out}") == 1, proc.stdout[-4000:]
    assert "algorithm" not in proc.stdout  # no table: no step ran


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--density", "0"], "argument --density: density must be in (0, 1], got 0.0"),
        (["--density", "inf"], "density must be in (0, 1], got inf"),
        (["-m", "16X"], "argument -m/--size: expecting a size like 4096, 64K or 16M"),
        (["--algorithms", "dense,nosuch"], "unknown algorithm 'nosuch'"),
        (["-i", "0"], "argument -i/--iterations: expecting an integer >= 1, got '0'"),
        (["--grads", "0"], "argument --grads: expecting an integer >= 1, got '0'"),
        (["--rows", "1", "--width", "0"], "argument --width: expecting an integer >= 1"),
        (["--rows", "1", "--width", "8192"], "expecting --width <= n, got --width 8192"),
        (["-m", "1024G"], "n = 1099511627776 is too large for this host's"),
        # refused, but the message named --algorithm, an option step.py does not have
        (["--algorithms", ","], "expecting algorithm names or 'all', got --algorithms ','"),
    ],
)
def test_step_benchmark_usage_errors(args: list[str], message: str) -> None:
    """Bad arguments used to be found late, each rank with its traceback: a density out of
    (0, 1] when the first reducer was built, an unknown algorithm after the ones before it
    had run, -i 0 or --grads 0 in a ZeroDivisionError or IndexError, 2**40 in a
    MemoryError. Now a usage error (exit 2) on every rank before MPI starts, printed once."""
    argv = [str(ROOT / "bench" / "step.py"), "-m", "4K", "-i", "1", "-x", "0", *args]
    proc = run_mpi(2, argv, timeout=300, env={"SPARSECOLL_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stdout[-4000:]
    assert proc.stdout.count(message) == 1, proc.stdout[-4000:]
    assert proc.stdout.count("usage: step.py") == 1, proc.stdout[-4000:]
    assert "Traceback" not in proc.stdout
    assert not any(ln.startswith("algorithm ") for ln in proc.stdout.splitlines())  # no table


@pytest.mark.mpi
def test_step_benchmark_runs_a_repeated_algorithm_once(tmp_path) -> None:
    """--algorithms dense,gtopk,dense ran dense twice: the CSV had its steps twice and the
    table one row, its numbers the second run's."""
    out = tmp_path / "dup.csv"
    args = ["-m", "4K", "-i", "2", "-x", "0", "--algorithms", "dense,gtopk,dense"]
    proc = run_mpi(
        2,
        [str(ROOT / "bench" / "step.py"), *args, "--csv", str(out)],
        timeout=300,
        env={"SPARSECOLL_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert [r["algorithm"] for r in csv.DictReader(out.open())] == ["dense"] * 2 + ["gtopk"] * 2


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        # the late ranks raised in time.sleep(-1) alone: rank 0 hung in its iallreduce
        ("overlap.py", ["--late", "-1"], "argument --late: expecting a number >= 0, got '-1'"),
        ("overlap.py", ["--late", "nan"], "argument --late: expecting a number >= 0"),
        ("overlap.py", ["--algorithm", "oktop"], "unknown algorithm 'oktop' (did you mean"),
    ],
)
def test_mpi_bench_scripts_refuse_bad_arguments_on_every_rank(script, args, message) -> None:
    """Under mpiexec every rank refuses alike before MPI starts, rank 0 alone prints."""
    _refused(script, ["-n", "4K", "--iterations", "1", "--warmup", "0", *args], message)


def _refused(script: str, args: list[str], message: str) -> None:
    """``bench/SCRIPT ARGS`` on 2 ranks: exit 2, ``message`` once, no traceback."""
    argv = [str(ROOT / "bench" / script), *args]
    proc = run_mpi(2, argv, timeout=300, env={"SPARSECOLL_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stdout[-4000:]
    assert proc.stdout.count(message) == 1, proc.stdout[-4000:]
    assert "Traceback" not in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # an unknown name was skipped without a word: its rows missing, exit 0
        (["--algorithms", "dense", "oktop/first"], "unknown algorithm 'oktop' (did you mean"),
        (["--np", "0"], "argument --np: expecting an integer >= 1, got '0'"),
        (["--density", "0"], "density must be in (0, 1], got 0.0"),
        (["--overlap", "skew"], "argument --overlap: invalid choice: 'skew'"),
    ],
)
def test_weak_scaling_refuses_bad_arguments(args: list[str], message: str) -> None:
    import subprocess
    import sys

    argv = [sys.executable, str(ROOT / "bench" / "weak_scaling.py"), "--np", "1", "-n", "1024"]
    argv += ["-i", "1", "-x", "0", *args]
    import os

    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.count(message) == 1, proc.stderr[-2000:]


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        # each used to end in a traceback on every rank, after MPI and torch had started
        ("convergence.py", ["--density", "0"], "density must be in (0, 1], got 0.0"),
        ("convergence.py", ["--steps", "0"], "argument --steps: expecting an integer >= 1"),
        ("convergence.py", ["--eval-every", "0"], "argument --eval-every: expecting an integer"),
        ("train_cluster.py", ["--threads", "0"], "argument --threads: expecting an integer >= 1"),
        # these ran until torch or numpy refused them, after MPI, torch and the corpus
        ("convergence.py", ["--lr", "0"], "argument --lr: expecting a number > 0, got '0'"),
        ("convergence.py", ["--lr", "nan"], "argument --lr: expecting a number > 0"),
        ("convergence.py", ["--seed", "-1"], "argument --seed: expecting an integer >= 0"),
        ("train_cluster.py", ["--vocab", "64"], "expecting --cutoffs below --vocab 64, got 16384"),
        ("train_cluster.py", ["--cutoffs", "16,8"], "argument --cutoffs: expecting increasing"),
        ("train_cluster.py", ["--cutoffs", "0"], "argument --cutoffs: expecting increasing"),
        ("train_cluster.py", ["--d-model", "10"], "expecting --d-model a multiple of --heads 4"),
        ("train_cluster.py", ["--max-steps", "0"], "argument --max-steps: expecting an integer"),
        ("train_cluster.py", ["--time-factor", "0"], "argument --time-factor: expecting a number"),
        ("train_cluster.py", ["--lr", "-1"], "argument --lr: expecting a number > 0, got '-1'"),
        ("train_cluster.py", ["--bucket-mb", "nan"], "argument --bucket-mb: expecting a number"),
        ("train_cluster.py", ["--seed", "-1"], "argument --seed: expecting an integer >= 0"),
    ],
)
def test_training_scripts_refuse_bad_arguments(script, args, message) -> None:
    pytest.importorskip("torch")
    _refused(script, ["--methods", "dense", *args], message)


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("script", "option"), [("convergence.py", "--out"), ("train_cluster.py", "--out-dir")]
)
def test_training_scripts_refuse_an_output_they_cannot_write(tmp_path, script, option) -> None:
    """An output under a file (not a folder) failed on rank 0 once training was done (a
    NotADirectoryError or FileExistsError traceback): now every rank stops before training."""
    pytest.importorskip("torch")
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "out"
    args = ["--methods", "dense", "--steps", "2", "--eval-every", "1", option, str(out)]
    _refused(script, args, f"error: cannot write {out}")


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        # rank 0 alone failed on the empty statistics once every run was done
        ("oktopk_density.py", ["--steps", "5", "--skip", "5"], "expecting --skip < --steps 5"),
        ("oktopk_density.py", ["--density", "0"], "argument --density: density must be in"),
        ("exdyna_threshold.py", ["--steps", "5", "--skip", "5"], "expecting --skip < --steps 5"),
        ("exdyna_threshold.py", ["--n", "0"], "argument --n: sizes must be positive, got '0'"),
    ],
)
def test_study_scripts_refuse_bad_arguments_on_every_rank(script, args, message) -> None:
    _refused(script, args, message)
