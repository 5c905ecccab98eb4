#!/usr/bin/env python3
"""Plot OSU-suite CSV files: latency vs size (one panel per P) and bytes per rank vs P.

    python -m sparsecoll bench osu --np 4 -m 1M:64M --format csv > shm_p4.csv
    python bench/plot_osu.py shm_p4.csv shm_p8.csv -o figures/ --title "shared memory"

Writes ``latency_vs_size.png`` (avg latency, log-log, one line per algorithm, dense dashed)
and ``bytes_vs_p.png`` (bytes sent per rank per call at one size, ``--size``, default the
largest size measured at every P). Needs matplotlib (``pip install 'sparsecoll[bench]'``).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from sparsecoll.benchmarks.cli import SIZE_HELP, check_columns, out_arg, readable, size_arg
from sparsecoll.benchmarks.model import OSU_COLUMNS, read_rows

__all__ = ["load", "main"]


def load(paths: list[str]) -> list[dict]:
    """Rows of every CSV (the suite's ``--format csv``), numbers converted, errors dropped."""
    rows = read_rows(paths)
    if not rows:
        raise SystemExit("no rows to plot")
    return rows


def _style(name: str) -> dict:
    return {"linestyle": "--", "color": "black"} if name == "dense" else {"marker": "o"}


def _panel(ax, series: dict, xlabel: str, ylabel: str, title: str) -> None:
    """One log-log panel, a line per algorithm (dense dashed)."""
    for name, pts in sorted(series.items()):
        pts = sorted(set(pts))
        ax.plot([x for x, _ in pts], [y for _, y in pts], label=name, **_style(name))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_latency(rows: list[dict], out: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    ps = sorted({r["P"] for r in rows})
    fig, axes = plt.subplots(1, len(ps), figsize=(5.5 * len(ps), 4.2), squeeze=False)
    for ax, p in zip(axes[0], ps):
        series = defaultdict(list)
        for r in rows:
            if r["P"] == p:
                series[r["algorithm"]].append((r["n"], r["avg_us"] / 1e3))
        density = ", ".join(sorted({str(r["density"]) for r in rows if r["P"] == p}))
        head = f"{title + ', ' if title else ''}P = {p}, density {density}"
        _panel(ax, series, "dense length n", "avg latency (ms)", head)
    return _save(fig, out / "latency_vs_size.png")


def plot_bytes(rows: list[dict], out: Path, title: str, size: int | None) -> Path:
    import matplotlib.pyplot as plt

    ps = sorted({r["P"] for r in rows})
    if size is None:
        common = set.intersection(*({r["n"] for r in rows if r["P"] == p} for p in ps))
        if not common:
            raise SystemExit("no size was measured at every P: pass --size")
        size = max(common)
    series = defaultdict(list)
    for r in rows:
        if r["n"] == size:
            series[r["algorithm"]].append((r["P"], r["bytes_per_rank"]))
    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    head = f"{title + ', ' if title else ''}n = {size}"
    _panel(ax, series, "ranks P", "bytes sent per rank per call", head)
    return _save(fig, out / "bytes_vs_p.png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=SIZE_HELP)
    p.add_argument("csv", type=readable, nargs="+", help="CSV files written with --format csv")
    p.add_argument(
        "-o",
        "--out",
        type=out_arg(parents=True, folder=True),
        default=".",
        help="output folder (default .)",
    )
    p.add_argument("--title", default="", help="prefix of the panel titles")
    p.add_argument(
        "--size", type=size_arg, default=None, help="n for the bytes-vs-P figure (K/M/G ok)"
    )
    args = p.parse_args(argv)
    check_columns(p, args.csv, OSU_COLUMNS, "an OSU-suite CSV (--format csv)")
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        print("matplotlib is not available: pip install 'sparsecoll[bench]'", file=sys.stderr)
        return 2
    rows = load(args.csv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for path in (plot_latency(rows, out, args.title), plot_bytes(rows, out, args.title, args.size)):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
