#!/usr/bin/env python3
"""Markdown table of a bench/sweep_exact.py run (its text output), as in docs/reports/exact.md.

One row per (P, n, density, overlap); each algorithm's cell is ``median latency · bytes sent
per rank``; the fastest of dense, allgather, dsa and recursive_doubling is in bold; ``auto``
shows its own time and its pick.

    python bench/sweep_exact.py --np 2,4,8 -i 3 -x 1 > docs/reports/data/exact_sweep.txt
    python bench/sweep_table.py docs/reports/data/exact_sweep.txt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
from sparsecoll.benchmarks.cli import readable

FIXED = ("dense", "allgather", "dsa", "recursive_doubling")
SHORT = {"recursive_doubling": "rd"}


def read(path: str) -> list[dict]:
    """The rows of a bench/sweep_exact.py table (numbers converted)."""
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            parts = line.split()
            if line.startswith("#") or len(parts) < 12 or parts[0] == "P":
                continue
            try:
                rows.append(_row(parts))
            except ValueError:
                where = f"{path}, line {number}"
                raise ValueError(f"{where}: not a row of bench/sweep_exact.py's table") from None
    return rows


def _row(parts: list[str]) -> dict:
    """One table row's fields (a ValueError where a number is not one)."""
    return {
        "P": int(parts[0]),
        "n": int(parts[1]),
        "density": parts[2],
        "overlap": parts[3],
        "algorithm": parts[4],
        "median": float(parts[5]),
        "bytes": int(parts[8]),
        "ok": parts[11],
        "note": parts[12] if len(parts) > 12 else "",
    }


def size(n: int) -> str:
    return f"{n >> 20}M" if n % 2**20 == 0 else f"{n:,}"


def nbytes(b: int) -> str:
    return f"{b / 1024:.1f} KiB" if b < 100 * 1024 else f"{b / 2**20:.2f} MiB"


def ms(t: float) -> str:
    return f"{t:.2f} ms" if t < 10 else f"{t:.1f} ms"


def density(text: str) -> str:
    return f"{float(text.rstrip('%')):g}%"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", type=readable, help="text output of bench/sweep_exact.py")
    args = ap.parse_args(argv)
    groups: dict[tuple, dict[str, dict]] = {}
    try:
        rows = read(args.sweep)
    except ValueError as exc:
        ap.error(str(exc))
    for r in rows:
        key = (r["P"], r["n"], r["density"], r["overlap"])
        groups.setdefault(key, {})[r["algorithm"]] = r
    print("| P | n | density | overlap | " + " | ".join(FIXED) + " | auto (choice) |")
    print("|" + "---|" * (5 + len(FIXED)))
    for (p, n, dens, overlap), algos in groups.items():
        present = [a for a in FIXED if a in algos]
        best = min(present, key=lambda a: algos[a]["median"]) if present else None
        cells = []
        for a in FIXED:
            r = algos.get(a)
            if r is None:
                cells.append("–")
                continue
            text = f"{ms(r['median'])} · {nbytes(r['bytes'])}"
            if r["ok"] != "yes":
                text += " (wrong)"
            cells.append(f"**{text}**" if a == best else text)
        auto = algos.get("auto")
        if auto:
            pick = SHORT.get(auto["note"], auto["note"])
            cells.append(f"{ms(auto['median'])} · {nbytes(auto['bytes'])} ({pick})")
        else:
            cells.append("–")
        row = [str(p), size(n), density(dens), overlap, *cells]
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
