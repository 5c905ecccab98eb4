"""oktopk-style kept-count table from a bench/convergence.py CSV: K/k per step after warm-up.

K/k is the step's achieved density over the requested one (``achieved_density`` in the CSV:
the update's nonzeros over n, every bucket together), over the steps after the dense warm-up
and ``SETTLE`` more (bench/convergence.py's definitions: the same band, the same period-2
verdict). Prints a Markdown table, one row per method, and the out-of-band steps.

  python bench/density_table.py docs/reports/data/convergence/convergence_charlm_3000.csv \\
      --methods oktopk,oktopk+mc,oktopk-paper
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convergence import BAND, CYCLE_AC, CYCLE_SPREAD, SETTLE, ratio_stats, step_ratios


def main(argv: list[str] | None = None) -> int:
    from sparsecoll.benchmarks.cli import check_columns, density_arg, int_arg, readable

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=readable)
    ap.add_argument("--methods", default=None, help="comma-separated (default: all but dense)")
    ap.add_argument("--density", type=density_arg, default=0.01, help="the run's --density")
    ap.add_argument("--warmup", type=int_arg(1), default=1, help="the run's --warmup")
    ap.add_argument(
        "--show", type=int_arg(0), default=10, help="out-of-band steps listed per method"
    )
    args = ap.parse_args(argv)
    columns = ("method", "achieved_density")
    check_columns(ap, [args.csv], columns, "a CSV of bench/convergence.py")

    runs: dict[str, list[dict]] = defaultdict(list)
    with open(args.csv, newline="") as f:
        for row in csv.DictReader(f):
            runs[row["method"]].append(row)
    methods = (
        [m.strip() for m in args.methods.split(",") if m.strip()]
        if args.methods
        else [m for m in runs if m != "dense"]
    )
    first = args.warmup + SETTLE + 1  # the first step counted (steps are 1-based)
    print(
        f"# {args.csv}: K/k over steps {first}..end (warm-up {args.warmup} + {SETTLE} settle "
        f"steps left out), band [{BAND[0]}, {BAND[1]}]; period-2 cycle: lag-1 "
        f"autocorrelation <= {CYCLE_AC} and std(K/k) >= {CYCLE_SPREAD}"
    )
    print(
        "| method | steps | min K/k | max K/k | mean K/k | std | in band | lag-1 autocorr. "
        "| period-2 cycle |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    outliers = {}
    for m in methods:
        rows = runs.get(m)
        if not rows:
            print(f"| {m} | (not in the CSV) |||||||")
            continue
        ratio = step_ratios(rows, args.warmup, args.density)
        s = ratio_stats(ratio)
        lag1 = "–" if np.isnan(s["ratio_lag1"]) else f"{s['ratio_lag1']:+.2f}"
        print(
            f"| {m} | {ratio.size} | {s['ratio_min']:.3f} | {s['ratio_max']:.3f} "
            f"| {s['ratio_mean']:.3f} | {s['ratio_std']:.3f} | {s['in_band']:.1%} | {lag1} "
            f"| {'yes' if s['period2'] else 'no'} |"
        )
        out = np.flatnonzero((ratio < BAND[0]) | (ratio > BAND[1]))
        if out.size:
            outliers[m] = [(int(i) + first, float(ratio[i])) for i in out]
    for m, steps in outliers.items():
        shown = ", ".join(f"{st}: {r:.3f}" for st, r in steps[: args.show])
        more = f" (+{len(steps) - args.show} more)" if len(steps) > args.show else ""
        print(f"# {m}: {len(steps)} step(s) out of the band (step: K/k): {shown}{more}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
