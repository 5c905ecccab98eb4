"""Replay auto's rule on a recorded sweep: how close its picks come to the fastest, per α.

    python bench/auto_fit.py docs/reports/data/exact_sweep.txt [--alpha 5e-6,5e-5,2e-4,1e-3]

For each configuration of the sweep (output of bench/sweep_exact.py, table format) and each
latency constant α, ``choose`` picks an algorithm from (P, n, N) as on a first call; its
measured median is divided by the fastest of dense/allgather/dsa/recursive_doubling. Prints
the median, geometric mean and worst of that ratio, and how often the pick was the fastest.
Use it to fit ``Auto(alpha=...)`` to a machine from a sweep run on it.
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
from pathlib import Path

import numpy as np

from sparsecoll.algorithms.auto import CostModel, choose
from sparsecoll.benchmarks.cli import floats_arg, readable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_table import read

ALGORITHMS = ("dense", "allgather", "dsa", "recursive_doubling")


def load(paths: list[str]) -> dict:
    rows: dict = collections.OrderedDict()
    for path in paths:
        for r in read(path):
            key = (r["P"], r["n"], float(r["density"].rstrip("%")) / 100, r["overlap"])
            rows.setdefault(key, {})[r["algorithm"]] = r["median"]
    return {k: v for k, v in rows.items() if all(a in v for a in ALGORITHMS)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("paths", type=readable, nargs="+")
    p.add_argument("--alpha", type=floats_arg(0), default="5e-6,5e-5,2e-4,1e-3", help="seconds")
    args = p.parse_args(argv)
    try:
        rows = load(args.paths)
    except ValueError as exc:  # (not a sweep_exact table: a traceback from int())
        p.error(str(exc))
    if not rows:  # (np.median of no ratios: nan and numpy's warnings)
        names = " ".join(map(str, args.paths))
        p.error(f"no configuration in {names} has a row of each of {', '.join(ALGORITHMS)}")
    print(f"# {len(rows)} configurations from {', '.join(map(str, args.paths))}")
    print(f"{'alpha':>8} {'median':>7} {'geomean':>8} {'worst':>7} {'fastest':>8}  picks")
    for alpha in args.alpha:
        model = CostModel(alpha=alpha)
        ratios, picks = [], collections.Counter()
        for (P, n, density, _), t in rows.items():
            nnz = P * round(density * n)  # make_problem's k per rank
            name = choose(P, n, nnz, np.int32, np.float32, None, model)
            picks[name] += 1
            ratios.append(t[name] / min(t[a] for a in ALGORITHMS))
        r = np.array(ratios)
        geo = math.exp(float(np.log(r).mean()))
        print(
            f"{alpha:>8.0e} {np.median(r):>7.2f} {geo:>8.2f} {r.max():>7.1f} "
            f"{int((r == 1).sum()):>4}/{len(r):<3}  {dict(picks)}"
        )


if __name__ == "__main__":
    main()
