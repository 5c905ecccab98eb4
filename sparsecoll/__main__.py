"""Command line: ``python -m sparsecoll bench [osu] [options]``."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import threading
from typing import Any

from ._launch import mpiexec_command, under_mpi

USAGE = """usage: python -m sparsecoll bench [SUITE] [--np P] [options]
       python -m sparsecoll algorithms
       python -m sparsecoll --version

commands:
  bench         run a benchmark suite (python -m sparsecoll bench [SUITE] --help)
  algorithms    list the registered algorithms and their options

suites of bench:
  (none)   every algorithm on one problem, in steady state (one instance reused, as in
           training); each result checked (exact: against the dense sum; selecting:
           against the algorithm's contract); times projected onto 1 and 10 Gbit/s links
  osu      OSU-style latency/bytes sweep over sizes, instances reused per size (--no-reuse:
           a fresh one per call; --table: one table, a column pair per algorithm)

bench parses its arguments, then (when not already started by mpiexec) relaunches itself
under `mpiexec -n P` (--np P, default 4). Sizes are element counts with binary suffixes
(K = 2**10, M = 2**20, G = 2**30: 64K, 16M, 1G); a decimal or an exponent is taken when the
count is whole (1.5M = 1572864, 1e6), not rounded (1.5 is refused).
"""

ALGORITHMS_USAGE = """usage: python -m sparsecoll algorithms

List the registered algorithms (built-in and entry-point plug-ins), each with its kind
(exact or selecting) and its options with their defaults."""

SUITES = {"main": "sparsecoll.benchmarks.main", "osu": "sparsecoll.benchmarks.osu"}


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # (| head: the reader left; a listing cut short is no error of ours)
        # stdout to /dev/null, so the interpreter's flush at exit does not raise it again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if argv and argv[0] in ("--version", "-V", "algorithms"):
        command, extra = argv[0], argv[1:]
        if command == "algorithms" and extra[:1] in (["-h"], ["--help"]):
            print(ALGORITHMS_USAGE)
            return 0
        if extra:  # (they were taken and ignored: a typo, or a wrong command, went unseen)
            usage = "algorithms" if command == "algorithms" else "--version"
            print(
                f"usage: python -m sparsecoll {usage}\n"
                f"python -m sparsecoll {command}: error: unrecognized arguments: "
                f"{' '.join(extra)}",
                file=sys.stderr,
            )
            return 2
        if command == "algorithms":
            from .registry import describe_algorithms

            print(describe_algorithms())
            return 0
        from . import __version__

        print(f"sparsecoll {__version__}")
        return 0
    if not argv or argv[0] != "bench":
        from .registry import did_you_mean

        hint = did_you_mean(argv[0], ["bench", "algorithms"]) if argv else ""
        got = f"unknown command {argv[0]!r}{hint}\n" if argv else ""
        print(f"{got}{USAGE}", file=sys.stderr)
        return 2
    rest = argv[1:]
    suite = "main"
    if rest and rest[0] in SUITES:
        suite = rest.pop(0)
    elif rest and not rest[0].startswith("-"):  # (argparse: "unrecognized arguments: foo")
        from .registry import did_you_mean

        hint = did_you_mean(rest[0], list(SUITES))
        print(
            f"python -m sparsecoll bench: error: unknown suite {rest[0]!r}{hint}; suites: "
            f"{', '.join(SUITES)} (main when none is given)",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(SUITES[suite])
    # parse here, before relaunching: help and usage errors print once, not once per rank
    args = module.parse_args(rest)
    if under_mpi():
        from .comm import Communicator

        try:  # (refused with another MPI's launcher: every process a rank 0 of its own)
            Communicator()
        except RuntimeError as exc:  # each process says so
            print(f"python -m sparsecoll bench: error: {exc}", file=sys.stderr)
            return 2
        return int(module.run(args) or 0)
    try:
        cmd = [*mpiexec_command(args.np), sys.executable, "-m", "sparsecoll", "bench"]
        return relaunch(cmd + ([] if suite == "main" else [suite]) + rest)
    except (RuntimeError, OSError) as exc:  # no mpiexec, or one that cannot be started
        print(f"python -m sparsecoll bench: error: {exc}", file=sys.stderr)
        return 2


def relaunch(cmd: list[str]) -> int:
    """Run ``cmd`` (an mpiexec) to its end and return its exit status, as a shell reports it.

    A signal that would end this process (SIGTERM, SIGHUP, SIGINT) is passed on to mpiexec,
    which stops its ranks, and mpiexec is waited for: no rank outlives the command. One that
    arrives while mpiexec is being started is held and passed on as soon as it has started;
    if it cannot be started, this process ends as the signal would have ended it. A Ctrl-C
    typed in a terminal reaches mpiexec too; the copy passed on counts as the second Ctrl-C
    that makes MPICH's mpiexec abort at once.
    """
    started: list[subprocess.Popen[bytes]] = []
    held: list[int] = []

    def forward(sig: int, _: Any) -> None:
        if started:
            started[0].send_signal(sig)
        else:  # (mpiexec may exist already, not yet known here: Popen has not returned)
            held.append(sig)

    # (signal handlers can be set from the main thread only: from another one, mpiexec's
    # signals are its own to take)
    # (and not a signal this process ignores, e.g. SIGHUP under nohup or SIGINT in a shell's
    # background job: a handler here would give mpiexec the default action instead of the
    # ignoring it inherits)
    main = threading.current_thread() is threading.main_thread()
    sigs = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT) if main else ()
    sigs = tuple(sig for sig in sigs if signal.getsignal(sig) is not signal.SIG_IGN)
    old = {sig: signal.signal(sig, forward) for sig in sigs}
    try:
        proc = subprocess.Popen(cmd)
        started.append(proc)
        for sig in held:
            proc.send_signal(sig)
        code = proc.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if held and not started:  # (the handlers are this process's own again)
            os.kill(os.getpid(), held[0])
    return code if code >= 0 else 128 - code  # killed by signal S: 128 + S, as a shell says


if __name__ == "__main__":
    sys.exit(main())
