"""Command line: ``python -m sparsecoll bench [osu] [options]``."""

from __future__ import annotations

import subprocess
import sys

from ._launch import find_mpiexec, under_mpi

USAGE = """usage: python -m sparsecoll bench [SUITE] [--np P] [options]

suites:
  (none)   every algorithm on one default problem, checked against dense
  osu      OSU-style latency/bytes sweep (see --help)

When not already started by mpiexec, relaunches itself under `mpiexec -n P` (default 4).
"""

SUITES = {"main": "sparsecoll.benchmarks.main", "osu": "sparsecoll.benchmarks.osu"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "bench":
        print(USAGE, file=sys.stderr)
        return 2
    rest = argv[1:]
    suite = "main"
    if rest and rest[0] in SUITES:
        suite = rest.pop(0)
    nprocs = 4
    if "--np" in rest:
        i = rest.index("--np")
        nprocs = int(rest[i + 1])
        del rest[i : i + 2]
    if not under_mpi():
        cmd = [find_mpiexec(), "-n", str(nprocs), sys.executable, "-m", "sparsecoll", "bench"]
        cmd += ([] if suite == "main" else [suite]) + rest
        return subprocess.call(cmd)
    import importlib

    return int(importlib.import_module(SUITES[suite]).main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
