#!/usr/bin/env python3
"""Markdown tables from OSU-suite CSV files (``--format csv``), for docs/reports/benchmarks.md.

One row per (P, n, algorithm): median latency over the timed calls, ``speedup vs dense``
(dense median / this median: > 1 is faster than dense), exact payload bytes per rank, and,
with ``--rate``, the wire-time floor of each row (bytes per rank / link rate) and how far the
measured median is above it.

    python bench/osu_table.py docs/reports/data/emu_1gbit_p4.csv \\
        docs/reports/data/emu_1gbit_p8.csv --rate 1gbit --sizes 25557032
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
from sparsecoll.benchmarks.cli import SIZE_HELP, readable, sizes_arg
from sparsecoll.benchmarks.model import read_rows

sys.path.insert(0, str(Path(__file__).resolve().parent))
from emulate_cluster import parse_rate, rate_arg


def fmt_us(us: float) -> str:
    return f"{us / 1e3:,.1f} ms" if us >= 1e3 else f"{us:,.0f} µs"


def table(rows: list[dict], rate_bps: float | None, sizes: set[int] | None) -> str:
    head = ["P", "n", "algorithm", "median", "speedup vs dense", "bytes/rank"]
    if rate_bps:
        head += ["wire floor", "median / floor"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    dense = {(r["P"], r["n"]): r["median_us"] for r in rows if r["algorithm"] == "dense"}
    keyed = sorted(rows, key=lambda r: (r["P"], r["n"], r["algorithm"] != "dense"))
    for r in keyed:
        n = r["n"]
        if sizes and n not in sizes:
            continue
        med = r["median_us"]
        base = dense.get((r["P"], r["n"]))
        ratio = f"{base / med:.2f}×" if base and med > 0 else "–"
        if r.get("valid") not in ("", "yes", "True", "true", "1"):
            ratio += " (invalid)"
        nbytes = r["bytes_per_rank"]
        cells = [str(r["P"]), f"{n:,}", f"`{r['algorithm']}`", fmt_us(med), ratio, f"{nbytes:,}"]
        if rate_bps:
            floor_us = nbytes * 8 / rate_bps * 1e6
            cells += [fmt_us(floor_us), f"{med / floor_us:.1f}" if floor_us > 0 else "–"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def pivot(rows: list[dict]) -> str:
    """One row per algorithm, one column per n: median latency and (× dense)."""
    sizes = sorted({r["n"] for r in rows})
    dense = {r["n"]: r["median_us"] for r in rows if r["algorithm"] == "dense"}
    cell: dict[tuple[str, int], str] = {}
    for r in rows:
        n, med = r["n"], r["median_us"]
        base = dense.get(n)
        cell[(r["algorithm"], n)] = fmt_us(med) + (
            f" ({base / med:.2f}×)" if base and r["algorithm"] != "dense" else ""
        )
    algos = sorted({r["algorithm"] for r in rows}, key=lambda a: (a != "dense", a))
    out = ["| algorithm | " + " | ".join(f"n = {size_label(n)}" for n in sizes) + " |"]
    out.append("|" + "---|" * (len(sizes) + 1))
    for a in algos:
        out.append(f"| `{a}` | " + " | ".join(cell.get((a, n), "–") for n in sizes) + " |")
    return "\n".join(out)


def size_label(n: int) -> str:
    for div, unit in ((2**30, "G"), (2**20, "M"), (2**10, "K")):
        if n % div == 0:
            return f"{n // div}{unit}"
    return f"{n:,}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=SIZE_HELP)
    ap.add_argument("csv", type=readable, nargs="+")
    ap.add_argument(
        "--rate", type=rate_arg, default=None, help="link rate for the wire floor (e.g. 1gbit)"
    )
    ap.add_argument(
        "--sizes",
        type=sizes_arg,
        default=None,
        help="n to keep: a comma list, K/M/G suffixes (default: all)",
    )
    ap.add_argument("--pivot", action="store_true", help="one row per algorithm, one column per n")
    args = ap.parse_args(argv)
    sizes = set(args.sizes) if args.sizes else None
    rate = parse_rate(args.rate) if args.rate else None
    rows = [r for r in read_rows(args.csv) if not sizes or r["n"] in sizes]
    print(pivot(rows) if args.pivot else table(rows, rate, sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
