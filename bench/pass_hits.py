"""What the training step's pass costs with and without its hits (``select.accumulate``).

The pass (``acc = grad + residual``, the entries at or above a cut recorded) streams three
n-arrays; every recorded hit also costs a visit of its word's set bits, a store of its
index and value and, with a histogram, a counter. This times the pass on the same data at
several cuts (no hits, the reducer's usual ~1.6% of n, more) next to one
``np.add(a, b, out=c)`` of two n-arrays, both timed in every round (the VM's memory speed
drifts), and prints the medians and the cost per hit over the pass without hits.

    SPARSECOLL_NUM_THREADS=1 python bench/pass_hits.py -m 16M
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np


def main(argv: list[str] | None = None) -> None:
    from sparsecoll import select
    from sparsecoll.benchmarks.cli import SIZE_HELP, int_arg, size_arg

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=SIZE_HELP)
    ap.add_argument(
        "-m", "--size", type=size_arg, default="16M", help="vector length n (K/M/G suffixes)"
    )
    ap.add_argument(
        "-i", "--iterations", type=int_arg(1), default=25, help="rounds (3 untimed first)"
    )
    ap.add_argument("--seed", type=int_arg(0), default=0)
    args = ap.parse_args(argv)
    n = args.size
    rng = np.random.default_rng(args.seed)
    g = rng.standard_normal(n, dtype=np.float32)
    r = rng.standard_normal(n, dtype=np.float32) * np.float32(0.5)
    acc = np.empty(n, np.float32)
    a, b, c = np.ones(n, np.float32), np.ones(n, np.float32), np.empty(n, np.float32)
    mags = np.abs(g + r)
    workspace: dict = {}
    cases = {"no hits": {"cut": math.inf}}
    for share in (0.01, 0.016, 0.03):  # the cut that gives this share of n as hits
        cut = float(np.quantile(mags[: min(n, 1 << 20)], 1 - share))
        cases[f"{share:.1%} hits"] = {"cut": cut, "cap": int(2 * share * n) + 1024}
        cases[f"{share:.1%} hits, histogram, zeroing"] = {
            "cut": cut, "cap": int(2 * share * n) + 1024, "buckets": True,
            "zero_cut": cut * 1.05,
        }  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in cases}
    hits: dict[str, int] = {}
    adds = []
    for it in range(args.iterations + 3):
        for name, kw in cases.items():
            t = time.perf_counter()
            np.add(a, b, out=c)
            add = time.perf_counter() - t
            t = time.perf_counter()
            found = select.accumulate(g, r, out=acc, workspace=workspace, **kw)
            took = time.perf_counter() - t
            if it >= 3:
                adds.append(add)
                times[name].append(took)
            hits[name] = found.hits
    ref = float(np.median(adds))
    base = float(np.median(times["no hits"]))
    print(f"# select.accumulate on n = {n:,} float32, {select.get_num_threads()} thread(s)")
    print(f"# np.add(a, b, out=c) of two n-arrays: {ref * 1e3:.2f} ms (median)")
    print(f"{'case':<36}{'hits':>10}{'ms':>8}{'x add':>7}{'ns/hit':>8}")
    for name in cases:
        med = float(np.median(times[name]))
        per = (med - base) / hits[name] * 1e9 if hits[name] else float("nan")
        print(f"{name:<36}{hits[name]:>10,}{med * 1e3:>8.2f}{med / ref:>7.2f}{per:>8.1f}")


if __name__ == "__main__":
    main()
