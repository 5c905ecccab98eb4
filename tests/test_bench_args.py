"""The single-process bench scripts refuse what they cannot use before any work: a usage
error (exit 2, one line naming the option), not a traceback once the work is done."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

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
        ("sweep_exact.py", ["-n", "0"], "argument -n: sizes must be positive, got '0'"),
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


def _main(script: str):
    """``bench/SCRIPT``'s ``main``, the script loaded in this process (the environment it
    sets at import, such as OMP_NUM_THREADS, put back after)."""
    spec = importlib.util.spec_from_file_location(Path(script).stem, ROOT / "bench" / script)
    mod = importlib.util.module_from_spec(spec)
    with mock.patch.dict(os.environ):
        spec.loader.exec_module(mod)
    return mod.main


MISSING = "no/such/file.csv"
SWEEP = str(ROOT / "docs" / "exact_sweep.txt")
SHM = str(RESULTS / "shm_p2.csv")


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        # a missing input was a FileNotFoundError traceback (IsADirectoryError for a folder)
        ("plot_osu.py", [MISSING], f"argument csv: cannot read {MISSING}: no such file"),
        ("plot_convergence.py", [MISSING], f"argument csv: cannot read {MISSING}: no such"),
        ("plot_train_cluster.py", ["no/such", "-o", "x.png"], "cannot read no/such: no such fol"),
        ("plot_train_cluster.py", [SHM, "-o", "x.png"], f"cannot read {SHM}: not a folder"),
        ("osu_table.py", [SHM, "docs"], "argument csv: cannot read docs: not a file"),
        ("sweep_table.py", [MISSING], f"argument sweep: cannot read {MISSING}: no such file"),
        ("density_table.py", [MISSING], f"argument csv: cannot read {MISSING}: no such file"),
        ("auto_fit.py", [MISSING], f"argument paths: cannot read {MISSING}: no such file"),
        ("project_model.py", ["--shm", MISSING], f"argument --shm: cannot read {MISSING}"),
        ("project_model.py", ["--shm", SHM, "--emulated", MISSING], "argument --emulated: canno"),
        # a file of another kind: a ValueError traceback from int()
        ("sweep_table.py", [str(ROOT / "README.md")], "not a row of bench/sweep_exact.py's table"),
        ("auto_fit.py", [SHM], "no configuration in"),
        # unknown names failed on every rank at their first call, with a traceback
        ("sweep_exact.py", ["--algorithms", "dense,oktop"], "unknown algorithm 'oktop' (did you"),
        ("sweep_exact.py", ["--algorithms", ","], "expecting algorithm names or 'all', got --al"),
        ("sweep_exact.py", ["--overlap", "rand"], "argument --overlap: unknown overlap 'rand'"),
        ("sweep_exact.py", ["--np", "2.5"], "argument --np: expecting an integer >= 1, got '2.5'"),
        ("gpu_step.py", ["--algorithms", "dense,nosuch"], "unknown algorithm 'nosuch'; known:"),
        ("gpu_step.py", ["--density", "0"], "argument --density: density must be in (0, 1]"),
        # unchecked: a traceback (int(), an empty median, Numba's thread count) or a wrong run
        ("project_model.py", ["--shm", SHM, "-n", "1.5"], "argument -n: expecting a whole numb"),
        ("project_model.py", ["--shm", SHM, "-n", "3"], "n = 3 is not in the --shm files"),
        ("project_model.py", ["--shm", SHM, "--P", "8,0"], "argument --P: expecting an integer"),
        ("project_model.py", ["--shm", SHM, "--links", "1gbit"], "unknown link preset '1gbit'"),
        ("project_model.py", ["--shm", SHM, "--emu-rate", "1gb"], "expecting a rate like 1gbit"),
        ("auto_fit.py", [SWEEP, "--alpha", "5e-6,-1"], "argument --alpha: expecting a number >="),
        ("bench_select.py", ["--sizes", "1M,1.5"], "argument --sizes: expecting a whole number"),
        ("bench_select.py", ["--densities", "0"], "argument --densities: density must be in"),
        ("bench_select.py", ["--repeat", "0"], "argument --repeat: expecting an integer >= 1"),
        ("bench_select.py", ["--threads", "0"], "argument --threads: expecting an integer >= 1"),
        ("bench_select.py", ["--torch-max-n", "3O"], "argument --torch-max-n: expecting a size"),
        ("oktopk_regions.py", ["--every", "0"], "argument --every: expecting an integer >= 1"),
        ("oktopk_regions.py", ["--imbalance", "0"], "argument --imbalance: expecting a number >"),
        ("exdyna_threshold.py", ["--n", "1e-3"], "argument --n: expecting a whole number"),
    ],
)
def test_bench_scripts_refuse_bad_inputs_in_process(capsys, script, args, message) -> None:
    """A usage error (exit 2) naming the option, before any work (parsed in this process)."""
    with pytest.raises(SystemExit) as exc:
        _main(script)(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count(message) == 1, err
    assert err.count("usage:") == 1


@pytest.mark.parametrize(
    "script",
    [
        "async_step.py",
        "exdyna_threshold.py",
        "gpu_step.py",
        "oktopk_density.py",
        "oktopk_regions.py",
        "osu_table.py",
        "pass_hits.py",
        "pass_processes.py",
        "plot_osu.py",
        "project_model.py",
        "step.py",
        "sweep_exact.py",
        "weak_scaling.py",
    ],
)
def test_every_size_option_documents_one_spelling(capsys, script) -> None:
    """Every script taking a size says in its --help how sizes are spelled, in one text."""
    from sparsecoll.benchmarks.cli import SIZE_HELP

    with pytest.raises(SystemExit) as exc:
        _main(script)(["--help"])
    assert exc.value.code == 0
    assert SIZE_HELP in " ".join(capsys.readouterr().out.split())
