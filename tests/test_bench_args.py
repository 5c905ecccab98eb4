"""The single-process bench scripts refuse what they cannot use before any work: a usage
error (exit 2, one line naming the option), not a traceback once the work is done."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .mpirun import ROOT

RESULTS = ROOT / "docs" / "results"


def _run(script: str, args: list[str]) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    argv = [sys.executable, str(ROOT / "bench" / script), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, check=False)


def _refused(script: str, args: list[str], message: str) -> None:
    proc = _run(script, args)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.count(message) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("script", "inputs", "option"),
    [
        ("plot_convergence.py", [str(ROOT / "bench" / "results" / "convergence_digits.csv")], "-o"),
        ("plot_osu.py", [str(RESULTS / "shm_p2.csv")], "-o"),
        ("plot_train_cluster.py", [str(RESULTS / "ttl_p4")], "-o"),
    ],
)
def test_plot_scripts_refuse_an_output_they_cannot_write(tmp_path, script, inputs, option) -> None:
    """An output under a file (not a folder) failed once the figure was drawn (a
    FileExistsError or NotADirectoryError traceback, exit 1): now a usage error first."""
    pytest.importorskip("matplotlib")
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "out.png"
    _refused(script, [*inputs, option, str(out)], f"argument -o/--out: cannot write {out}")


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        # each ran with the bad value: a table of nan or nothing, or a late traceback
        ("density_table.py", ["--density", "0"], "argument --density: density must be in"),
        ("density_table.py", ["--warmup", "-1"], "argument --warmup: expecting an integer >= 1"),
        ("pass_hits.py", ["-m", "4K", "-i", "0"], "argument -i/--iterations: expecting an"),
        ("pass_hits.py", ["-m", "4X"], "argument -m/--size: expecting a size like"),
        ("pass_processes.py", ["--processes", "0"], "argument --processes: expecting an integer"),
        ("pass_processes.py", ["--share", "0"], "argument --share: density must be in"),
        ("sweep_exact.py", ["--density", "0.01,0"], "argument --density: density must be in"),
        ("sweep_exact.py", ["-n", "0"], "argument -n: expecting positive integers"),
        ("sweep_exact.py", ["-i", "0"], "argument -i/--iterations: expecting an integer >= 1"),
    ],
)
def test_bench_scripts_refuse_bad_arguments(script, args, message) -> None:
    inputs = [str(ROOT / "bench" / "results" / "convergence_digits.csv")]
    _refused(script, [*(inputs if script == "density_table.py" else []), *args], message)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--density", "0.01,0"], "argument --density: density must be in (0, 1], got 0.0"),
        (["--max-dense", "-1"], "argument --max-dense: expecting a size like"),
    ],
)
def test_gpu_bench_refuses_bad_arguments(args, message) -> None:
    """Parsed before any GPU is looked for: a density of 0 ran on empty inputs."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    argv = [sys.executable, "-m", "sparsecoll.benchmarks.gpu", "select", *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.count(message) == 1, proc.stderr[-2000:]
