"""The pass's time with hits, process by process: a cost that depends on where arrays land.

Whether two arrays written at one running position share an L1 set depends on their
addresses, so it differs from process to process (address randomisation). This starts
``--processes`` fresh Python processes; each times ``select.accumulate`` on n float32 at
``--share`` hits (and without hits) over ``--rounds`` rounds, next to ``np.add``, and prints
its medians; the summary counts the processes whose pass with hits took more than
``--slow`` times the same process's pass without hits.

    SPARSECOLL_NUM_THREADS=1 python bench/pass_processes.py -m 16M
    PYTHONPATH=/tmp/old SPARSECOLL_NUM_THREADS=1 python bench/pass_processes.py   # a library
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def one(n: int, share: float, rounds: int) -> dict:
    """Medians (ms) of one process: the pass with hits, without, and np.add."""
    from sparsecoll import select

    rng = np.random.default_rng(0)
    g = rng.standard_normal(n, dtype=np.float32)
    r = rng.standard_normal(n, dtype=np.float32) * np.float32(0.5)
    acc, c = np.empty(n, np.float32), np.empty(n, np.float32)
    cut = float(np.quantile(np.abs(g[: 1 << 20] + r[: 1 << 20]), 1 - share))
    workspace: dict = {}
    times: dict[str, list[float]] = {"hits": [], "no hits": [], "add": []}
    for it in range(rounds + 1):  # the first round compiles and touches: untimed
        for name, run in (
            ("hits", lambda: select.accumulate(g, r, out=acc, cut=cut, workspace=workspace)),
            ("no hits", lambda: select.accumulate(g, r, out=acc, workspace=workspace)),
            ("add", lambda: np.add(g, r, out=c)),
        ):
            t = time.perf_counter()
            run()
            if it:
                times[name].append(time.perf_counter() - t)
    return {k: 1e3 * float(np.median(v)) for k, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    from sparsecoll.benchmarks.cli import SIZE_HELP, density_arg, float_arg, int_arg, size_arg

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=SIZE_HELP)
    ap.add_argument(
        "-m", "--size", type=size_arg, default="16M", help="vector length n (K/M/G suffixes)"
    )
    ap.add_argument("--share", type=density_arg, default=0.02, help="hits, as a share of n")
    ap.add_argument("--processes", type=int_arg(1), default=10)
    ap.add_argument("--rounds", type=int_arg(1), default=12)
    ap.add_argument(
        "--slow",
        type=float_arg(0, above=True),
        default=1.25,
        help="slow: hits / no hits above this",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    n = args.size
    if args.child:
        print(json.dumps(one(n, args.share, args.rounds)))
        return
    print(f"# select.accumulate on n = {n:,} float32, {args.share:.1%} hits, one process a row")
    print(f"{'process':>7} {'hits ms':>8} {'no hits':>8} {'add ms':>8} {'hits/no':>8}")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "-m", str(n)]
    cmd += ["--share", str(args.share), "--rounds", str(args.rounds)]
    ratios = []
    for p in range(args.processes):
        done = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
        row = json.loads(done.stdout)
        ratios.append(row["hits"] / row["no hits"])
        print(
            f"{p:>7} {row['hits']:>8.2f} {row['no hits']:>8.2f} {row['add']:>8.2f} "
            f"{ratios[-1]:>8.2f}"
        )
    slow = sum(x > args.slow for x in ratios)
    print(f"# {slow} of {len(ratios)} processes slow (hits / no hits > {args.slow})")


if __name__ == "__main__":
    main()
