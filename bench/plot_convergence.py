"""Plot a CSV from bench/convergence.py: evaluation metric and bytes per rank vs step.

python bench/plot_convergence.py digits.csv [-o digits.png]
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convergence import FIELDS


def main(argv: list[str] | None = None) -> int:
    from sparsecoll.benchmarks.cli import check_columns, out_arg, readable, writable

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=readable)
    ap.add_argument(
        "-o",
        "--out",
        type=out_arg(parents=True),
        default=None,
        help="PNG (default: beside the CSV)",
    )
    args = ap.parse_args(argv)
    check_columns(ap, [args.csv], FIELDS, "a CSV of bench/convergence.py", rows=True)
    if args.out is None and not writable(args.csv.with_suffix(".png")):
        ap.error(f"cannot write {args.csv.with_suffix('.png')} (beside the CSV): give -o")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: dict[str, list[dict]] = defaultdict(list)
    with open(args.csv, newline="") as f:
        for row in csv.DictReader(f):
            runs[row["method"]].append(row)
    task = next(iter(runs.values()))[0]["task"]
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.4))
    ax_loss, ax_eval, ax_dens, ax_bytes = axes
    for method, rows in runs.items():
        steps = [int(r["step"]) for r in rows]
        ev = [r for r in rows if r["eval_loss"]]
        es = [int(r["step"]) for r in ev]
        style = {"lw": 2.2, "color": "k"} if method == "dense" else {"lw": 1.4}
        # train loss, smoothed over 20 steps (mini-batch noise)
        tl = [float(r["train_loss"]) for r in rows]
        sm = [
            sum(tl[max(0, i - 19) : i + 1]) / len(tl[max(0, i - 19) : i + 1])
            for i in range(len(tl))
        ]
        ax_loss.plot(steps, sm, label=method, **style)
        if task == "digits":
            ax_eval.plot(es, [100 * float(r["eval_acc"]) for r in ev], label=method, **style)
        else:
            ax_eval.plot(es, [float(r["eval_loss"]) for r in ev], label=method, **style)
        ax_dens.plot(
            steps[1:], [float(r["achieved_density"]) for r in rows[1:]], label=method, **style
        )
        ax_bytes.plot(
            steps, [float(r["bytes_sent_total"]) / 1e6 for r in rows], label=method, **style
        )
    ax_loss.set(title=f"{task}: train loss (20-step mean)", xlabel="step", yscale="log")
    if task == "digits":
        ax_eval.set(title="held-out accuracy (%)", xlabel="step", ylim=(90, 100))
    else:
        ax_eval.set(title="held-out loss (nats/char)", xlabel="step")
    ax_dens.set(title="achieved density of the update", xlabel="step", yscale="log")
    ax_bytes.set(title="MB sent per rank (cumulative)", xlabel="step", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
    ax_eval.legend(fontsize=8)
    fig.tight_layout()
    out = args.out or args.csv.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
