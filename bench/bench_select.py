"""Selection benchmark: our top-k, threshold and estimators against np.argpartition (and
torch.topk when torch is installed), on float32 Gaussian gradients, in one process.

Every figure is the median (and min) of --repeat timed runs after one untimed warm-up run,
so Numba's compile (or cache load) stays out; the compile/load time is printed apart.

    PYTHONPATH=$PWD python bench/bench_select.py                      # 1M, 25M, 100M
    PYTHONPATH=$PWD python bench/bench_select.py --sizes 1M --format csv
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import sparsecoll
from sparsecoll import select as sel
from sparsecoll.benchmarks.cli import DTYPES, densities_arg, int_arg, size_arg, sizes_arg

SIZE_HELP = (  # (the other tools' suffixes are binary: sparsecoll.benchmarks.cli.SIZE_HELP)
    "Sizes are element counts: digits, a decimal or an exponent, with an optional suffix "
    "K = 10**3, M = 10**6, G = 10**9 (decimal, unlike the other tools' binary ones), a whole "
    "number in all: 4096, 25M (= 25000000), 1.5M (= 1500000), 1e6."
)


def _label(n: int) -> str:
    """``n`` as written with the largest decimal suffix it is a multiple of (30M)."""
    units = ((10**9, "G"), (10**6, "M"), (10**3, "K"))
    return next((f"{n // u}{s}" for u, s in units if n % u == 0), str(n))


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, float, Any]:
    """(median s, min s, last result) over ``repeat`` runs after one warm-up run."""
    out = fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), float(np.min(times)), out


def count_of(out: Any) -> int:
    if isinstance(out, sel.Selection):
        return out.count
    if isinstance(out, tuple):
        return int(out[0].shape[0])
    if isinstance(out, (int, np.integer)):
        return int(out)
    return int(out.shape[0])


def methods(x: np.ndarray, k: int, t: float, torch: Any) -> dict[str, Callable[[], Any]]:
    """The timed calls; the first is the baseline the speedups divide."""
    n = x.shape[0]
    m: dict[str, Callable[[], Any]] = {
        "np.argpartition": lambda: np.argpartition(np.abs(x), n - k)[n - k :],
    }
    if torch is not None:
        xt = torch.from_numpy(x)
        m["torch.topk"] = lambda: torch.topk(torch.abs(xt), k, sorted=False).indices
    m["topk"] = lambda: sel.topk(x, k)
    m["threshold"] = lambda: sel.threshold(x, t)
    m["count_ge"] = lambda: sel.count_ge(x, t)
    m["kth_largest_abs"] = lambda: sel.kth_largest_abs(x, k)
    exact = sel.ExactThreshold(k)
    m["ExactThreshold"] = lambda: exact.select(x)
    reuse = sel.ReuseThreshold(k, interval=10**9)
    reuse.select(x)  # the recompute step; every timed call below reuses
    m["ReuseThreshold(reuse step)"] = lambda: reuse.select(x)
    sampling = sel.SamplingThreshold(k, seed=1)
    m["SamplingThreshold"] = lambda: sampling.select(x)
    gaussian = sel.GaussianThreshold(k)
    m["GaussianThreshold"] = lambda: gaussian.select(x)
    return m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=SIZE_HELP)
    ap.add_argument(
        "--sizes", type=functools.partial(sizes_arg, decimal=True), default="1M,25M,100M"
    )
    ap.add_argument("--densities", type=densities_arg, default="0.001,0.01")
    ap.add_argument("--repeat", type=int_arg(1), default=5)
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument("--backend", default=None, choices=["numba", "numpy"])
    ap.add_argument(
        "--threads",
        type=int_arg(1),
        default=None,
        help="Numba threads (default: cores / ranks per node)",
    )
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument(
        "--torch-max-n",
        type=functools.partial(size_arg, decimal=True),
        default="30M",
        help="skip torch.topk above this n (it is slow)",
    )
    ap.add_argument("--format", default="table", choices=["table", "csv", "json"])
    args = ap.parse_args(argv)
    sel.set_backend(args.backend)

    torch = None
    if not args.no_torch:
        try:
            import torch  # type: ignore[no-redef]
        except ImportError:
            torch = None

    if args.threads is not None:
        try:  # (more than the cores: a ValueError traceback)
            sel.set_num_threads(args.threads)
        except ValueError as exc:
            ap.error(f"argument --threads: {exc}")
    t0 = time.perf_counter()
    sel.warmup(parallel=True)
    compile_s = time.perf_counter() - t0
    threads = "-"
    if sel.backend() == "numba":
        import numba

        try:
            layer = numba.threading_layer()
        except ValueError:  # one thread: the serial kernels never start Numba's pool
            layer = "serial kernels"
        threads = f"{sel.get_num_threads()} ({layer})"
    load = os.getloadavg()[0]
    print(f"# sparsecoll {sparsecoll.__version__} selection benchmark ({args.dtype}, Gaussian)")
    print(f"# backend {sel.backend()}, threads {threads}, warm-up/compile {compile_s:.1f} s")
    tv = "not used (--no-torch)" if args.no_torch else "not installed"
    tv = f"{torch.__version__} (up to n = {_label(args.torch_max_n)})" if torch else tv
    print(f"# numpy {np.__version__}, torch {tv}")
    print(f"# cpus {os.cpu_count()}, load average at start {load:.2f}")
    print(f"# median and min of {args.repeat} runs after 1 warm-up; speedup = argpartition / ours")
    print(f"# command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")

    rows = []
    header = f"{'n':>11} {'density':>8} {'method':<27} {'median ms':>10} {'min ms':>9} "
    header += f"{'speedup':>8} {'count/k':>8} {'tries':>5}"
    if args.format == "table":
        print(header)
    for n in args.sizes:
        x = np.random.default_rng(0).standard_normal(n, dtype=np.float32).astype(args.dtype)
        for density in args.densities:
            k = max(1, round(density * n))
            t = sel.kth_largest_abs(x, k)
            base = None
            use_torch = torch if n <= args.torch_max_n else None
            for name, fn in methods(x, k, t, use_torch).items():
                med, mn, out = timed(fn, args.repeat)
                base = med if base is None else base
                row = {
                    "n": n, "density": density, "method": name, "median_ms": med * 1e3,
                    "min_ms": mn * 1e3, "speedup": base / med,
                    "count_over_k": count_of(out) / k if name != "kth_largest_abs" else None,
                    "tries": out.tries if isinstance(out, sel.Selection) else None,
                }  # fmt: skip
                rows.append(row)
                if args.format == "table":
                    ck = "-" if row["count_over_k"] is None else f"{row['count_over_k']:.3f}"
                    tr = "-" if row["tries"] is None else str(row["tries"])
                    print(
                        f"{n:>11} {density:>8g} {name:<27} {med * 1e3:>10.2f} {mn * 1e3:>9.2f} "
                        f"{base / med:>7.1f}x {ck:>8} {tr:>5}",
                        flush=True,
                    )
        del x
    if args.format == "csv":
        print(",".join(rows[0]))
        for r in rows:
            print(",".join("" if v is None else str(v) for v in r.values()))
    elif args.format == "json":
        print(json.dumps(rows, indent=1))
    print(f"# load average at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
