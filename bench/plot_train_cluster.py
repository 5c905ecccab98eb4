"""Plot bench/train_cluster.py's CSVs: held-out loss vs wall-clock, and the step's parts.

python bench/plot_train_cluster.py ttl_p4 [ttl_p8 ...] -o ttl.png

One row of two panels per directory (one CSV per method in it): held-out loss against
wall-clock (evaluation excluded) with dense's final loss as a dashed line; and per method the
median step split into the time backward waited on communication (``wait_s``), the rest of
the step (compute, as slowed by whatever ran beside it), and the communication in flight that
backward did not wait for (hidden); a black tick marks the no-communication step (the
``compute`` method).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

FIELDS = ("step_s", "comm_s", "wait_s")
COLUMNS = ("step_s", "comm_s", "wall_s", "eval_loss")  # (wait_s: not in older CSVs)
ORDER = ("compute", "dense", "oktopk", "exdyna", "oktopk-async", "exdyna-async")


def read_dir(path: Path) -> dict[str, list[dict]]:
    runs = {}
    for f in sorted(path.glob("*.csv")):
        with open(f, newline="") as fh:
            runs[f.stem] = list(csv.DictReader(fh))
    rank = {m: i for i, m in enumerate(ORDER)}
    return dict(sorted(runs.items(), key=lambda kv: rank.get(kv[0], len(ORDER))))


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return (xs[n // 2] + xs[(n - 1) // 2]) / 2 if n else float("nan")


def step_parts(rows: list[dict]) -> tuple[float, float, float]:
    """Median step, communication in flight and backward's wait on it (seconds)."""
    body = rows[min(5, len(rows) // 4) :]  # as train_cluster.summarize
    return tuple(median([float(r.get(k) or 0) for r in body]) for k in FIELDS)


def main(argv: list[str] | None = None) -> int:
    from sparsecoll.benchmarks.cli import check_columns, out_arg, readable_folder

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", type=readable_folder, nargs="+")
    ap.add_argument("-o", "--out", type=out_arg(), required=True, help="PNG")
    args = ap.parse_args(argv)
    for d in args.dirs:  # (an empty folder was a ValueError from max() once the plot was drawn)
        found = sorted(d.glob("*.csv"))
        if not found:
            ap.error(f"no runs found in {d}: expecting bench/train_cluster.py's CSVs (--out-dir)")
        check_columns(ap, found, COLUMNS, "a CSV of bench/train_cluster.py", rows=True)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(args.dirs), 2, figsize=(13, 4.6 * len(args.dirs)), squeeze=False)
    for (ax_loss, ax_step), d in zip(axes, args.dirs):
        runs = read_dir(d)
        title = d.name
        for method, rows in runs.items():
            ev = [r for r in rows if r["eval_loss"]]
            if not ev:
                continue
            style = {"lw": 2.2, "color": "k"} if method == "dense" else {"lw": 1.5, "marker": "."}
            ax_loss.plot(
                [float(r["wall_s"]) for r in ev],
                [float(r["eval_loss"]) for r in ev],
                label=method,
                **style,
            )
        if "dense" in runs:
            target = float([r for r in runs["dense"] if r["eval_loss"]][-1]["eval_loss"])
            ax_loss.axhline(target, color="k", ls="--", lw=0.8, label="dense's final loss")
        ax_loss.set_xlabel("wall-clock (s, evaluation excluded)")
        ax_loss.set_ylabel("held-out loss (nats/token)")
        ax_loss.set_title(f"{title}: held-out loss vs wall-clock")
        ax_loss.legend(fontsize=8)
        ax_loss.grid(alpha=0.3)

        compute = step_parts(runs["compute"])[0] if "compute" in runs else None
        names, comp, waited, hidden = [], [], [], []
        old = any("wait_s" not in rows[0] for rows in runs.values())
        for method, rows in runs.items():
            step, comm, wait = step_parts(rows)
            if "wait_s" not in rows[0] and compute is not None:  # CSVs older than wait_s
                wait = max(0.0, step - compute)
            names.append(method)
            comp.append((step - wait) * 1e3)
            waited.append(wait * 1e3)
            hidden.append(max(0.0, comm - wait) * 1e3)
        ax_step.bar(names, comp, label="compute (step − waited)", color="tab:blue")
        ax_step.bar(names, waited, bottom=comp, label="backward waited on comm", color="tab:red")
        tops = [c + w for c, w in zip(comp, waited)]
        ax_step.bar(names, hidden, bottom=tops, label="comm in flight, not waited on",
                    color="tab:red", alpha=0.3, hatch="//")  # fmt: skip
        if compute is not None:
            ax_step.axhline(compute * 1e3, color="k", lw=0.8, ls=":", label="no-comm step")
        ax_step.set_ylim(0, 1.4 * max(c + w + h for c, w, h in zip(comp, waited, hidden)))
        ax_step.set_ylabel("median per step (ms)")
        note = "\n(no wait_s in these CSVs: waited = step − no-comm step)" if old else ""
        ax_step.set_title(f"{title}: where a step goes{note}")
        ax_step.tick_params(axis="x", rotation=20)
        ax_step.legend(fontsize=8)
        ax_step.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
