"""The command line as a user meets it: help and usage errors once, exit codes, sizes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from sparsecoll import available_algorithms
from sparsecoll.algorithms.auto import CANDIDATES
from sparsecoll.benchmarks.cli import parse_size, parse_sizes

from .mpirun import ROOT, run_mpi

_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")


def cli(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m sparsecoll ARGS`` as a user types it (not under mpiexec)."""
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in _LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "sparsecoll", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_top_level_help_exits_0() -> None:
    for flag in ("--help", "-h"):
        proc = cli(flag)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("usage: python -m sparsecoll bench")


def test_no_or_unknown_command_is_a_usage_error() -> None:
    proc = cli()
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage:")
    proc = cli("benhc")
    assert proc.returncode == 2
    assert "unknown command 'benhc' (did you mean 'bench'?)" in proc.stderr


@pytest.mark.parametrize("suite", [[], ["osu"]])
def test_bench_help_prints_once_and_shows_np(suite: list[str]) -> None:
    proc = cli("bench", *suite, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("usage: python -m sparsecoll bench") == 1
    assert "--np P" in proc.stdout
    assert "-m" in proc.stdout
    assert "--message-size" in proc.stdout
    assert "K = 2**10" in proc.stdout


SHORT = ("--np", "1", "-m", "1K", "-i", "1", "-x", "0")  # should a check let a run start


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-m", "16X"], "expecting a size like 4096, 64K or 16M, got '16X'"),
        (["-n", "16M"], "-n is ambiguous here: use --np P"),
        (["-i", "0"], "argument -i/--iterations: expecting an integer >= 1, got '0'"),
        (["osu", "-x", "-1"], "argument -x/--warmup: expecting an integer >= 0, got '-1'"),
        # density 0 ran every algorithm on empty inputs and printed a table of 'ok's
        (["--density", "0", *SHORT], "argument --density: density must be in (0, 1], got 0.0"),
        (["osu", "--density", "0", *SHORT], "density must be in (0, 1], got 0.0"),
        (["--density", "nan", *SHORT], "density must be in (0, 1], got nan"),
        (["--density", "1%", *SHORT], "expecting a density in (0, 1], got '1%'"),
        # density·n rounding to 0 nonzeros per rank: the same table of 'ok's on empty inputs
        (["--np", "1", "-m", "100", "--density", "0.001"], "= 0 nonzeros per rank"),
        (["osu", "--np", "1", "-m", "16:4K"], "--density 0.01 of n = 16 is round(0.16) = 0"),
        # more than the host's memory: a MemoryError traceback on every rank
        (["--np", "1", "-m", "1024G"], "n = 1099511627776 is too large for this host's"),
        (["osu", "--np", "1", "-m", "1K:1024G"], "n = 1099511627776 is too large"),
        (["osu", "--np", "1", "-m", "512G", "--dtype", "float64"], "n x 8 B = 4096.0 GiB"),
        (["--np", "0"], "expecting --np >= 1"),
        (["--algorithm", "nosuch"], "unknown algorithm 'nosuch'"),
        (["osu", "-m", "8K:1K"], "expecting MIN <= MAX"),
        (["osu", "-n", "4"], "-n is ambiguous here"),
        (["osu", "--algorithm", "dense,nosuch"], "unknown algorithm 'nosuch'"),
        (["--algorithm", "oktop"], "unknown algorithm 'oktop' (did you mean 'oktopk'?)"),
        # no name at all: osu printed nothing and exited 0; the main job ran dense alone
        (["osu", "--algorithm", "", *SHORT], "expecting algorithm names or 'all', got --algo"),
        (["--algorithm", " , ", *SHORT], "expecting algorithm names or 'all', got --algorithm"),
    ],
)
def test_usage_errors_print_once_before_any_launch(args: list[str], message: str) -> None:
    proc = cli("bench", *args)
    assert proc.returncode == 2
    assert proc.stderr.count(message) == 1, proc.stderr
    assert proc.stderr.count("usage:") == 1


def test_the_host_memory_check_leaves_gpu_runs_alone() -> None:
    """A dense vector beyond this host's memory is refused for host buffers only: a ``-d
    cuda`` run's vectors live on the GPU, whose memory the host's does not bound."""
    from sparsecoll.benchmarks import osu

    args = osu.parse_args(["-d", "cuda", "--np", "1", "-m", "1024G"])
    assert args.message_size == [2**40]
    with pytest.raises(SystemExit):
        osu.parse_args(["--np", "1", "-m", "1024G"])


def test_algorithms_command_lists_options() -> None:
    proc = cli("algorithms")
    assert proc.returncode == 0, proc.stderr
    for name in available_algorithms():
        assert f"{name} (" in proc.stdout
    assert "oktopk (selecting):" in proc.stdout
    assert "tau=32" in proc.stdout
    assert "dense (exact): no options" in proc.stdout


def test_algorithms_and_version_refuse_arguments_they_do_not_take() -> None:
    """``algorithms --bogus`` or ``--version extra`` listed the algorithms / printed the
    version and exited 0, the arguments ignored; ``algorithms --help`` says what it does."""
    for args in (["algorithms", "--bogus"], ["algorithms", "oktopk"], ["--version", "x"]):
        proc = cli(*args)
        assert proc.returncode == 2, (args, proc.stdout[-300:])
        assert proc.stdout == ""
        assert f"error: unrecognized arguments: {args[1]}" in proc.stderr
        assert proc.stderr.startswith("usage: python -m sparsecoll")
    proc = cli("algorithms", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m sparsecoll algorithms\n")
    assert "tau=32" not in proc.stdout


@pytest.mark.parametrize("args", [["algorithms"], ["--help"], ["--version"]])
def test_output_into_a_closed_pipe_is_no_traceback(args: list[str]) -> None:
    """``python -m sparsecoll algorithms | head -3``: the reader leaves before the listing is
    written; the command ends with status 1 and nothing on stderr (it printed a
    BrokenPipeError traceback)."""
    read, write = os.pipe()
    os.close(read)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "sparsecoll", *args],
            cwd=ROOT,
            env=env,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (1, "")


@pytest.mark.mpi
def test_help_under_mpiexec_prints_once() -> None:
    """Started by mpiexec directly, every rank parses but only rank 0 prints."""
    proc = run_mpi(3, ["-m", "sparsecoll", "bench", "--help"], timeout=120)
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("usage: python -m sparsecoll bench") == 1
    proc = run_mpi(3, ["-m", "sparsecoll", "bench", "osu", "-m", "1Q"], timeout=120)
    assert proc.returncode == 2, proc.stdout
    assert proc.stdout.count("expecting a size like") == 1


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--density", "0"], "density must be in (0, 1], got 0.0"),
        (
            ["osu", "-m", "1024G"],
            "the dense baseline's vector, n x 4 B = 4096.0 GiB per rank, 12288.0 GiB for 3 rank(s)",
        ),
    ],
)
def test_usage_errors_under_mpiexec_exit_2_once(args: list[str], message: str) -> None:
    """Started by mpiexec directly: every rank refuses alike (none left waiting in a
    collective), rank 0 alone prints; 2**40 elements counted for the 3 ranks of this host."""
    proc = run_mpi(3, ["-m", "sparsecoll", "bench", *args, "-i", "1", "-x", "0"], timeout=120)
    assert proc.returncode == 2, proc.stdout[-4000:]
    assert proc.stdout.count(message) == 1, proc.stdout[-4000:]


@pytest.mark.mpi
def test_main_bench_relaunches_and_names_its_check() -> None:
    """--np and a suffixed size; the header names the network, the steady state and the
    projection's links; the check column says what each result was checked against; auto
    names its pick."""
    proc = cli("bench", "--np", "2", "-m", "16K", "-i", "1", "-x", "0", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("# P=2 n=16384 ")
    assert lines[2].startswith("# network: shared memory, one host (2 ranks on ")
    assert lines[3].startswith("# steady state: one instance per algorithm, reused")
    assert any(line.startswith("# check: 'sum' = equals the exact dense sum") for line in lines)
    assert any("1G: alpha = 50 us/message, beta = 8 ns/byte (125 MB/s)" in line for line in lines)
    head = next(i for i, line in enumerate(lines) if line.startswith("algorithm"))
    assert lines[head].split() == [
        "algorithm",
        "check",
        "median",
        "ms",
        "speedup",
        "bytes/rank",
        "bytes",
        "ratio",
        "msgs",
        "1G",
        "ms",
        "10G",
        "ms",
        "result",
        "nnz",
    ]
    rows = {line.split()[0]: line.split() for line in lines[head + 1 :]}
    assert sorted(rows) == available_algorithms()
    picks = rows["auto"].pop(1)  # (its picks in the timed calls, a wire named with one)
    assert set(picks.strip("()").split("/")) <= set(CANDIDATES), picks
    for name in ("allgather", "dense", "dsa", "auto"):
        assert rows[name][1:3] == ["sum", "ok"], rows[name]
    for name in ("oktopk", "gtopk", "exdyna"):
        assert rows[name][1:3] == ["contract", "ok"], rows[name]
    for row in rows.values():  # the projection adds the link's time to the time here
        median, far1, far10 = float(row[3]), float(row[8]), float(row[9])
        assert median <= far10 <= far1, row
    assert proc.stdout.count("# P=2") == 1  # rank 0 alone prints


@pytest.mark.parametrize(
    ("version", "oversubscribe"),
    [
        ("mpiexec (Open MPI) 5.0.11", True),
        ("mpiexec (OpenRTE) 4.1.6", True),
        ("HYDRA build details:\n    Version: 4.3.0", False),
    ],
)
def test_relaunch_lets_open_mpi_oversubscribe(tmp_path, version: str, oversubscribe: bool) -> None:
    """Open MPI's mpiexec refuses more ranks than cores without --oversubscribe (MPICH's
    starts them): `bench` (--np 4 by default) failed on a 2-core machine with Open MPI."""
    fake = tmp_path / "mpiexec"
    fake.write_text(
        f'#!/bin/sh\nif [ "$1" = --version ]; then printf "{version}\\n"; exit 0; fi\n'
        'echo "launched: $*"\n'
    )
    fake.chmod(0o755)
    proc = cli("bench", "--np", "9", "-m", "16K", env={"SPARSECOLL_MPIEXEC": str(fake)})
    assert proc.returncode == 0, proc.stderr
    extra = "--oversubscribe " if oversubscribe else ""
    assert proc.stdout.startswith(f"launched: {extra}-n 9 {sys.executable} -m sparsecoll bench")


@pytest.mark.mpi
def test_bench_relaunches_more_ranks_than_cores() -> None:
    """The real launcher, P above the core count (bench's default P = 4 on a laptop)."""
    nprocs = (os.cpu_count() or 1) + 1
    if nprocs > 8:
        pytest.skip(f"{nprocs - 1} cores: too many ranks to oversubscribe in a test")
    proc = cli("bench", "--np", str(nprocs), "-m", "4K", "-i", "1", "-x", "0", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(f"# P={nprocs} n=4096 ") == 1


def test_sizes_take_binary_suffixes() -> None:
    assert parse_size("4096") == 4096
    assert parse_size("64K") == 64 * 2**10
    assert parse_size("16m") == 16 * 2**20
    assert parse_size("1G") == 2**30
    assert parse_sizes("64K:256K") == [2**16, 2**17, 2**18]
    for bad in ("16X", "0", "-3", "", "1T", "1e", "1e999", "1.5.0M"):
        with pytest.raises(ValueError, match="expecting a size like|sizes must be positive"):
            parse_size(bad)


def test_sizes_take_a_decimal_when_the_count_is_whole() -> None:
    """``overlap.py -n 1.5M`` ran (its own parser) until the shared one refused any decimal;
    ``bench_select.py --sizes 1.5M`` ran as 1,500,000 (its decimal suffixes) and
    ``--sizes 1.0000001M`` as 1,000,000, the fraction dropped without a word."""
    assert parse_size("1.5M") == 1_572_864
    assert parse_size("0.5K") == parse_size(".5k") == 512
    assert parse_size("1e6") == parse_size("1E6") == parse_size("1_000_000") == 10**6
    assert parse_size("1.5M", decimal=True) == 1_500_000
    assert parse_sizes("1.5K,2.5K") == [1536, 2560]
    for bad, value in (("1.5", "1.5"), ("1.0000001M", "1048576.1048576"), ("1e-3", "0.001")):
        with pytest.raises(ValueError, match=f"whole number of elements, got '{bad}' = {value}$"):
            parse_size(bad)
    with pytest.raises(ValueError, match="got '1.0000001M' = 1000000.1$"):
        parse_size("1.0000001M", decimal=True)


def test_input_files_are_checked_when_parsed(tmp_path) -> None:
    import argparse

    from sparsecoll.benchmarks.cli import readable, readable_folder

    (tmp_path / "f.csv").write_text("")
    assert readable(str(tmp_path / "f.csv")) == tmp_path / "f.csv"
    assert readable_folder(str(tmp_path)) == tmp_path
    for check, path, why in (
        (readable, tmp_path / "nosuch.csv", "no such file"),
        (readable, tmp_path, "not a file"),
        (readable_folder, tmp_path / "nosuch", "no such folder"),
        (readable_folder, tmp_path / "f.csv", "not a folder"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=f"^cannot read {path}: {why}$"):
            check(str(path))


def test_gpu_bench_takes_the_same_sizes(capsys) -> None:
    from sparsecoll.benchmarks import gpu

    with pytest.raises(SystemExit) as exc:
        gpu.main(["select", "-m", "16X"])
    assert exc.value.code == 2
    assert "expecting a size like 4096, 64K or 16M, got '16X'" in capsys.readouterr().err


def _fake_launcher(tmp_path, body: str):
    """An executable ``mpiexec`` script (``--version``: MPICH's Hydra) running ``body``."""
    fake = tmp_path / "mpiexec"
    fake.write_text(
        '#!/bin/bash\nif [ "$1" = --version ]; then echo "HYDRA"; exit 0; fi\n' + body + "\n"
    )
    fake.chmod(0o755)
    return fake


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=str)
def test_a_signal_to_bench_reaches_mpiexec(tmp_path, sig: signal.Signals) -> None:
    """`kill PID` (or a closed terminal) used to end the relaunching process alone: mpiexec
    and its ranks ran the benchmark on to its end; Ctrl-C SIGKILLed mpiexec, which then could
    not stop its ranks. Now the signal is passed on and mpiexec waited for."""
    fake = _fake_launcher(
        tmp_path,
        "".join(f"trap 'echo {s} > {tmp_path}/got; exit 99' {s}\n" for s in ("TERM", "HUP", "INT"))
        + f"echo $$ > {tmp_path}/pid\nwhile true; do sleep 0.05; done",
    )
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.update(SPARSECOLL_MPIEXEC=str(fake), PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparsecoll", "bench", "--np", "2", "-m", "4K"],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        # a shell's background job ignores SIGINT, and so would Python started from it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    pid_file = tmp_path / "pid"
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text().strip():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
        if pid_file.exists():  # the fake mpiexec, when the signal did not stop it
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
    got = tmp_path / "got"
    assert got.exists(), f"mpiexec never got {sig.name} (bench exited {code})"
    assert got.read_text().strip() == sig.name.removeprefix("SIG")
    assert code == 99  # mpiexec's exit status, once it had stopped


# relaunch() in a process of its own, whose Popen signals that process: "after" starting the
# launcher (once its traps are set) but before returning, "before" starting it
_SIGNAL_IN_POPEN = """
import os, signal, subprocess, sys, time
from pathlib import Path
from sparsecoll.__main__ import relaunch

when, sig, launcher, ready = sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
signal.signal(signal.SIGINT, signal.default_int_handler)

class Popen(subprocess.Popen):
    def __init__(self, cmd):
        if when == "before":
            os.kill(os.getpid(), sig)
        super().__init__(cmd)
        while when == "after" and not ready.read_text().strip():
            time.sleep(0.01)
        os.kill(os.getpid(), sig)

subprocess.Popen = Popen
sys.exit(relaunch([launcher]))
"""


def _signal_in_popen(tmp_path, when: str, sig: signal.Signals, launcher) -> int:
    pid = tmp_path / "pid"
    pid.write_text("")
    args = [when, str(int(sig)), str(launcher), str(pid)]
    try:
        return subprocess.run(
            [sys.executable, "-c", _SIGNAL_IN_POPEN, *args],
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            timeout=60,
            capture_output=True,
        ).returncode
    finally:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid.read_text()), signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=str)
def test_a_signal_while_mpiexec_starts_is_passed_on(tmp_path, sig: signal.Signals) -> None:
    """A signal in the moment between mpiexec's start and Popen's return ended the relaunching
    process alone (SIGTERM, SIGHUP), or raised KeyboardInterrupt out of it (SIGINT), and left
    mpiexec running. Now it is held and passed on once Popen returns."""
    fake = _fake_launcher(
        tmp_path,
        "".join(f"trap 'echo {s} > {tmp_path}/got; exit 99' {s}\n" for s in ("TERM", "HUP", "INT"))
        + f"echo $$ > {tmp_path}/pid\nwhile true; do sleep 0.05; done",
    )
    assert _signal_in_popen(tmp_path, "after", sig, fake) == 99  # mpiexec's exit status
    assert (tmp_path / "got").read_text().strip() == sig.name.removeprefix("SIG")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=str)
def test_a_signal_held_when_mpiexec_cannot_start_ends_the_process(tmp_path, sig) -> None:
    """The signal arrives while Popen runs, and Popen fails: the process ends by that signal
    (SIGINT: by Python's KeyboardInterrupt, which ends it by SIGINT too)."""
    assert _signal_in_popen(tmp_path, "before", sig, tmp_path / "nosuch") == -sig


@pytest.mark.parametrize("kind", ["missing", "not executable", "a directory", "blank"])
def test_a_bad_mpiexec_is_named_without_a_traceback(tmp_path, kind: str) -> None:
    """SPARSECOLL_MPIEXEC naming no executable used to end in a FileNotFoundError or
    PermissionError traceback from subprocess."""
    path = {"missing": tmp_path / "nosuch", "a directory": tmp_path, "blank": " "}
    path["not executable"] = tmp_path / "mpiexec"
    (tmp_path / "mpiexec").write_text("#!/bin/sh\necho launched\n")
    proc = cli("bench", "-m", "4K", env={"SPARSECOLL_MPIEXEC": str(path[kind])})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    message = f"bench: error: SPARSECOLL_MPIEXEC={str(path[kind])!r} is not an executable file"
    assert proc.stderr.strip().endswith(message), proc.stderr


def test_no_mpiexec_anywhere_is_an_error_without_a_traceback(tmp_path, monkeypatch, capsys):
    """Neither next to the interpreter nor on PATH: one line saying how to get one."""
    from sparsecoll import __main__ as entry

    for var in (*_LAUNCHER_VARS, "SPARSECOLL_MPIEXEC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert entry.main(["bench", "-m", "4K"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m sparsecoll bench: error: mpiexec not found: pip install")


def test_another_mpis_launcher_is_an_error_not_p_copies(tmp_path) -> None:
    """Open MPI's mpiexec in front of an MPICH mpi4py (or the reverse) starts P processes
    that each run as a world of one: bench used to print P tables of "P=1" and exit 0."""
    fake = _fake_launcher(  # as Open MPI's would: each process told the world's size
        tmp_path,
        "n=$2; shift 2; for ((i = 0; i < n; i++)); do\n"
        '  OMPI_COMM_WORLD_SIZE=$n OMPI_COMM_WORLD_RANK=$i "$@" & pids+=($!)\ndone\n'
        'rc=0; for p in "${pids[@]}"; do wait $p || rc=$?; done; exit $rc',
    )
    args = ("bench", "--np", "2", "-m", "4K", "-i", "1", "-x", "0", "--algorithm", "allgather")
    proc = cli(*args, env={"SPARSECOLL_MPIEXEC": str(fake)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "# P=" not in proc.stdout
    message = "the launcher started 2 processes (OMPI_COMM_WORLD_SIZE=2) but MPI"
    assert proc.stderr.count(message) == 2, proc.stderr


@pytest.mark.parametrize(
    ("world", "env", "wrong"),
    [
        (1, {"OMPI_COMM_WORLD_SIZE": "2"}, True),  # another MPI's launcher: P singletons
        (1, {"PMI_SIZE": "4"}, True),
        (1, {"PMI_SIZE": "1"}, False),  # a launch of one
        (2, {"OMPI_COMM_WORLD_SIZE": "4"}, False),  # left over from an outer launch
        (2, {"PMI_SIZE": "2"}, False),
        (3, {}, False),
        (1, {"MV2_COMM_WORLD_SIZE": "2"}, True),  # MVAPICH's mpirun_rsh
        # srun without the PMI plugin of mpi4py's MPI: each task (this very process) alone
        (1, {"SLURM_STEP_NUM_TASKS": "4", "SLURM_TASK_PID": "self"}, True),
        (4, {"SLURM_STEP_NUM_TASKS": "4", "SLURM_TASK_PID": "self"}, False),
        (1, {"SLURM_STEP_NUM_TASKS": "1", "SLURM_TASK_PID": "self"}, False),
        # started by a task's shell (an interactive step of 2 tasks): meant to run alone
        (1, {"SLURM_STEP_NUM_TASKS": "2", "SLURM_TASK_PID": "parent"}, False),
        (1, {"SLURM_NTASKS": "4", "SLURM_TASK_PID": "self"}, False),  # a batch script
    ],
)
def test_launcher_mismatch_is_p_worlds_of_one(monkeypatch, world, env, wrong) -> None:
    """Only a world of one under a launcher of several is another MPI's launcher: a variable
    inherited from an outer launch (a driver started by mpirun, a Slurm step) used to make
    bench refuse a world of the right size, with a message that called mpiexec another
    MPI's. MVAPICH's count and srun's were not looked at: `srun -n 4 python train.py`
    without the PMI plugin of mpi4py's MPI ran 4 jobs of one rank, silently."""
    from sparsecoll._launch import launcher_mismatch

    pids = {"self": str(os.getpid()), "parent": str(os.getppid())}
    for var in (*_LAUNCHER_VARS, "MV2_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, pids.get(value, value))
    assert (launcher_mismatch(world, "MPI X") is not None) == wrong


def test_relaunch_from_another_thread() -> None:
    """Signal handlers can be set from the main thread only: relaunch from another thread
    started mpiexec, then raised ValueError with nobody left waiting for it."""
    from sparsecoll import __main__ as entry

    got = []
    t = threading.Thread(target=lambda: got.append(entry.relaunch([sys.executable, "-c", "0"])))
    t.start()
    t.join(60)
    assert got == [0]


def test_relaunch_under_nohup_keeps_sighup_ignored() -> None:
    """Under nohup SIGHUP is ignored, and mpiexec inherited that; a handler set for it
    before starting mpiexec gave mpiexec the default action (a closed terminal ended it)."""
    from sparsecoll import __main__ as entry

    check = "import signal, sys; sys.exit(signal.getsignal(signal.SIGHUP) == signal.SIG_IGN)"
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert entry.relaunch([sys.executable, "-c", check]) == 1
    finally:
        signal.signal(signal.SIGHUP, old)
