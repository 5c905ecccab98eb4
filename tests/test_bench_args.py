"""The single-process bench scripts refuse what they cannot use before any work: a usage
error (exit 2, one line naming the option), not a traceback once the work is done."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from .mpirun import ROOT, run_mpi

DATA = ROOT / "tests" / "data"  # small copies of docs/reports/data files


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
        ("plot_convergence.py", [str(DATA / "convergence_digits.csv")], "-o"),
        ("plot_osu.py", [str(DATA / "shm_p2.csv")], "-o"),
        ("plot_train_cluster.py", [str(DATA / "ttl_p4")], "-o"),
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
        ("sweep_exact.py", ["--density", "0.01,0"], "argument --density: density must be in"),
        ("sweep_exact.py", ["-n", "0"], "argument -n: sizes must be positive, got '0'"),
        ("sweep_exact.py", ["-i", "0"], "argument -i/--iterations: expecting an integer >= 1"),
    ],
)
def test_bench_scripts_refuse_bad_arguments(script, args, message) -> None:
    inputs = [str(DATA / "convergence_digits.csv")]
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
SWEEP = str(DATA / "exact_sweep.txt")
SHM = str(DATA / "shm_p2.csv")


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
        ("sweep_exact.py", ["--rounds", "0"], "argument --rounds: expecting an integer >= 1, go"),
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
        "call_overhead.py",
        "exdyna_threshold.py",
        "gpu_kernels.py",
        "gpu_step.py",
        "oktopk_density.py",
        "osu_table.py",
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


DIGITS = str(DATA / "convergence_digits.csv")


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        # a CSV of another kind: a KeyError traceback ('P', 'method') once the script ran
        ("plot_osu.py", [DIGITS], f"{DIGITS} is not an OSU-suite CSV (--format csv): no column"),
        ("plot_convergence.py", [SHM], f"{SHM} is not a CSV of bench/convergence.py: no column"),
        ("density_table.py", [SHM], f"{SHM} is not a CSV of bench/convergence.py: no column me"),
        # an unchecked option: a held-out loss of nan or below 0 is never reached
        ("train_cluster.py", ["--target", "nan"], "argument --target: expecting a number > 0"),
        ("train_cluster.py", ["--target", "-1"], "argument --target: expecting a number > 0"),
        # refused once MPI had started (rank 0 printing, every rank exiting 2)
        ("train_cluster.py", ["--methods", "oktop"], "argument --methods: unknown method 'okt"),
        # none: nothing trained, exit 0
        ("train_cluster.py", ["--methods", ","], "argument --methods: expecting method names"),
        ("convergence.py", ["--methods", ","], "argument --methods: expecting method names"),
        # a typo was skipped ('not registered here'), the run going on without it, exit 0
        ("convergence.py", ["--methods", "dense,oktop+mc"], "unknown method 'oktop' (did you"),
        # a selecting algorithm ran, was marked NO against dense, the sweep exiting 1
        ("sweep_exact.py", ["--algorithms", "dense,oktopk"], "'oktopk' selects (it is not exac"),
    ],
)
def test_bench_scripts_refuse_inputs_of_another_kind(capsys, script, args, message) -> None:
    test_bench_scripts_refuse_bad_inputs_in_process(capsys, script, args, message)


def test_plot_train_cluster_refuses_a_folder_without_its_runs(tmp_path, capsys) -> None:
    """An empty folder was a ValueError from max() of an empty sequence once the figure was
    being drawn; a folder of other CSVs a KeyError ('eval_loss')."""
    main = _main("plot_train_cluster.py")
    out = str(tmp_path / "out.png")
    for files, message in [
        ({}, f"no runs found in {tmp_path}: expecting bench/train_cluster.py's CSVs"),
        ({"dense.csv": Path(SHM).read_text()}, "dense.csv is not a CSV of bench/train_cluster"),
        ({"dense.csv": "step_s,comm_s,wall_s,eval_loss\n"}, "dense.csv has no rows"),
    ]:
        for name, text in files.items():
            (tmp_path / name).write_text(text)
        with pytest.raises(SystemExit) as exc:
            main([str(tmp_path), "-o", out])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.count(message) == 1, err
    assert not os.path.exists(out)


def test_sweep_exact_all_is_every_exact_algorithm() -> None:
    """'all' is every exact algorithm, with its compact wire where it takes one (auto weighs
    those too); never a selecting one (each was marked NO, exit 1)."""
    from sparsecoll.benchmarks.cli import wire_variants
    from sparsecoll.registry import algorithm_class, available_algorithms

    spec = importlib.util.spec_from_file_location("sweep_exact", ROOT / "bench" / "sweep_exact.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    known = wire_variants(available_algorithms())
    exact = [n for n in known if algorithm_class(n.partition(":")[0]).exact]
    assert len(exact) < len(known) and "recursive_doubling:compact" in exact
    assert mod.parse(["--algorithms", "all"]).algorithms == exact
    assert mod.parse(["--algorithms", "dsa,dsa:compact"]).algorithms == ["dsa", "dsa:compact"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # plain int, checked only after the root and tool checks
        (["-n", "0"], "argument -n/--hosts: expecting an integer >= 1, got '0'"),
        (["-n", "2.5"], "argument -n/--hosts: expecting an integer >= 1, got '2.5'"),
        # checked only when tc ran, as root, once the namespaces were made
        (["--rate", "0gbit"], "argument --rate: expecting a rate like 1gbit or 100mbit"),
        (["--rate", "fast"], "argument --rate: expecting a rate like 1gbit or 100mbit"),
        (["--delay", "1 hour"], "argument --delay: expecting a time like 50us or 1ms"),
        (["--subnet", "8.8.8.0/24"], "argument --subnet: subnet must be private"),
        (["-n", "8", "--subnet", "10.0.0.0/29"], "argument --subnet: subnet 10.0.0.0/29 too sm"),
    ],
)
def test_emulate_cluster_refuses_bad_values_before_the_root_check(capsys, args, message) -> None:
    """Parsed in this process, before the root check (seen as no root here: without the
    checks a root test run would make the namespaces, as the script did)."""
    main = _main("emulate_cluster.py")
    with mock.patch("os.geteuid", return_value=1000), pytest.raises(SystemExit) as exc:
        main([*args, "--mpiexec", sys.executable, "--", "true"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count(message) == 1, err
    assert "needs root" not in err


def test_call_overhead_times_every_algorithm() -> None:
    """bench/call_overhead.py under mpiexec: a row for MPI's floor, the Communicator's calls
    and every registered algorithm, each with its two times."""
    from sparsecoll.registry import available_algorithms

    proc = run_mpi(2, [str(ROOT / "bench" / "call_overhead.py"), "-i", "2", "-x", "1"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = {}
    for line in proc.stdout.splitlines():
        *name, wall, cpu = line.split()
        if not line.startswith("#") and name and name[0] != "call":
            rows[" ".join(name)] = (float(wall), float(cpu))
    expected = {f"allreduce {a}" for a in available_algorithms()} | {
        "MPI Allreduce (dense n)",
        "Communicator.allgatherv",
    }
    assert expected <= rows.keys(), proc.stdout
    assert all(wall > 0 and cpu >= 0 for wall, cpu in rows.values())


def test_sweep_exact_summarizes_each_case(tmp_path, capsys) -> None:
    """The fastest exact algorithm (auto apart), auto's pick and its ratio; the CSV of
    cases, appended to by the later P of --np; the count of cases within 10%."""
    import argparse
    import io

    mod = _main("sweep_exact.py").__globals__
    case = mod["summarize"](2, 1024, 0.01, "zipf", {"dsa": 0.002, "auto": 0.0021}, "dsa")
    assert case["fastest"] == "dsa" and case["auto_ratio"] == pytest.approx(1.05)
    slow = mod["summarize"](3, 1024, 0.01, "hot", {"dsa": 0.004, "auto": 0.001, "dense": 0.001}, "")
    assert slow["fastest"] == "dense" and slow["auto_ratio"] == 1.0
    assert mod["summarize"](2, 1, 0.5, "same", {"auto": 1.0}, "dsa") is None
    path = tmp_path / "cases.csv"
    for first, cases in ((True, [case]), (False, [slow])):
        mod["report"](cases, argparse.Namespace(summary=str(path), no_header=not first), None)
    lines = path.read_text().splitlines()
    assert lines[0].startswith("P,n,density,overlap,fastest") and len(lines) == 3
    assert lines[1].startswith("2,1024,0.01,zipf,dsa,2,dsa,2.1,1.05")

    out = io.StringIO()
    mod["report"]([case, slow], argparse.Namespace(summary=None, no_header=False), out)
    assert (
        "auto within 10% of the fastest in 2 of 2 cases, picked the fastest in 1" in out.getvalue()
    )


SMALL = ["-n", "4K", "--density", "0.01", "--overlap", "random", "-i", "2", "-x", "1"]


def test_sweep_exact_rounds_time_every_algorithm_in_turn() -> None:
    """--rounds 2 under mpiexec: a row per algorithm, each checked against dense, a case line
    and the summary; the header names the rounds."""
    script = str(ROOT / "bench" / "sweep_exact.py")
    args = [script, *SMALL, "--algorithms", "allgather,dsa,auto", "--rounds", "2"]
    proc = run_mpi(2, args, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "iterations=2 warmup=1 rounds=2 latency" in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(" 2 ")]
    assert [r[4] for r in rows] == ["allgather", "dsa", "auto"], proc.stdout
    assert all(r[11] == "yes" for r in rows), proc.stdout
    counts = [int(p.rpartition("x")[2]) for p in rows[2][12:] if "x" in p]  # NAMExCOUNT
    assert sum(counts) in (0, 4) and len(rows[2]) > 12, proc.stdout  # one pick, or 4 counted
    assert proc.stdout.count("# case P=2 n=4096") == 1
    assert "# auto within 10% of the fastest in" in proc.stdout


def test_sweep_exact_rounds_rotate_the_order() -> None:
    """Every instance is warmed up first (settle_calls + -x calls), then each round times a
    block of -i calls of each, the order rotated by one; each algorithm reports R x -i."""
    from mpi4py import MPI

    from sparsecoll import Communicator
    from sparsecoll.benchmarks import main
    from sparsecoll.benchmarks.problems import make_problem

    measure = _main("sweep_exact.py").__globals__["measure"]
    real, blocks = main.time_calls, []

    def time_calls(comm, algos, vals, idx, n, skip=0):
        blocks.append((algos[0], len(algos), skip))  # (instance, calls, untimed)
        return real(comm, algos, vals, idx, n, skip)

    comm = Communicator(MPI.COMM_SELF)
    vals, idx = make_problem(4096, 0.01, 0, 1, "random", np.dtype("float32"))
    names = ["dense", "allgather", "auto"]
    args = argparse.Namespace(iterations=2, warmup=1, rounds=3)
    with mock.patch.object(main, "time_calls", time_calls):
        got = list(measure(comm, names, vals, idx, 4096, 41, args))
    warm, timed = blocks[:3], blocks[3:]
    assert all(calls == skip == a.settle_calls + 1 for a, calls, skip in warm)
    order = [names[[id(w[0]) for w in warm].index(id(a))] for a, _, _ in timed]
    assert order == [*names, *names[1:], names[0], names[2], *names[:2]]
    assert all((calls, skip) == (2, 0) for _, calls, skip in timed)
    assert [len(times) for _, times, _, _ in got] == [6, 6, 6]
    assert len(got[2][3]) == 6 and all(r.nnz == 41 for r, *_ in got)  # auto's picks
