#!/usr/bin/env python3
"""Markdown table of auto against the fastest exact algorithm, from bench/sweep_exact.py runs.

Reads the ``# case`` lines of one or more runs' text output: one row per (P, density), one
column per overlap; each cell is auto's median over the fastest algorithm's and auto's most
frequent pick (``rd`` = recursive_doubling, ``ag`` = allgather, ``:c`` = the compact wire),
and where that is not the fastest, the fastest and its time. Cells over ``--limit`` are in
bold. Ends with how many cases were within the limit.

    python bench/auto_table.py docs/reports/data/auto_sweep/*.txt
"""

from __future__ import annotations

import argparse
import re

CASE = re.compile(
    r"# case P=(\d+) n=(\d+) density=([\d.]+)% (\w+): fastest (\S+) ([\d.]+) ms; "
    r"auto picked (\S+), ([\d.]+)x the fastest"
)
SHORT = (("recursive_doubling", "rd"), ("allgather", "ag"), (":compact", ":c"))


def short(name: str) -> str:
    for long, abbrev in SHORT:
        name = name.replace(long, abbrev)
    return name


def read(paths: list[str]) -> list[tuple]:
    """(P, density %, overlap, fastest, its ms, auto's pick, auto's ratio) per case."""
    cases = []
    for path in paths:
        with open(path) as f:
            for line in f:
                m = CASE.match(line.strip())
                if m:
                    P, _, d, overlap, fastest, ms, pick, ratio = m.groups()
                    cases.append(
                        (int(P), float(d), overlap, fastest, float(ms), pick, float(ratio))
                    )
    return cases


def table(cases: list[tuple], limit: float) -> str:
    overlaps = list(dict.fromkeys(c[2] for c in cases))
    rows: dict[tuple, dict] = {}
    for P, d, overlap, fastest, ms, pick, ratio in cases:
        cell = f"{ratio:.2f} {short(pick)}"
        if pick != fastest:
            cell += f" (fastest {short(fastest)} {ms:.3g} ms)"
        rows.setdefault((P, d), {})[overlap] = f"**{cell}**" if ratio > limit else cell
    lines = [
        "| P | density | " + " | ".join(overlaps) + " |",
        "|---|---|" + "---|" * len(overlaps),
    ]
    for (P, d), cells in sorted(rows.items()):
        lines.append(f"| {P} | {d:g}% | " + " | ".join(cells.get(o, "") for o in overlaps) + " |")
    near = sum(c[6] <= limit for c in cases)
    picked = sum(c[3] == c[5] for c in cases)
    lines.append("")
    lines.append(
        f"auto within {limit:g}x of the fastest in {near} of {len(cases)} cases; "
        f"its most frequent pick was the fastest in {picked}."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("paths", nargs="+", help="text output of bench/sweep_exact.py")
    p.add_argument("--limit", type=float, default=1.1, help="ratio shown in bold above it")
    args = p.parse_args(argv)
    cases = read(args.paths)
    if not cases:
        p.error("no '# case' lines of bench/sweep_exact.py in " + ", ".join(args.paths))
    print(table(cases, args.limit))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
