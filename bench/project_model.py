#!/usr/bin/env python3
"""Validate the α-β model against emulated-cluster runs, then project latency to large P.

Inputs are CSV files of the OSU suite (``--format csv``), all for the same density/overlap:

* ``--shm``: shared-memory runs at P = 1, 2 (for the local-work fit) and at every P of the
  emulated runs (their median latency is the "no network" part of the validation);
* ``--emulated``: runs under bench/emulate_cluster.py at P ≤ 8 on a link of ``--emu-rate``.
  The emulated link's α is fitted from the smallest size in those files
  (α = median of (T_emulated − T_shm) / messages) unless ``--emu-alpha`` is given.

Prints markdown: (1) the byte/message formulas against the Communicator's counters,
(2) the validation (model vs measured on the emulated cluster, with the error),
(3) projected latency per link preset for P up to 1024. See docs/reports/benchmarks.md.

    python bench/project_model.py --shm shm_p*.csv --emulated emu_p*.csv --emu-rate 1gbit
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from sparsecoll.benchmarks.cli import (
    SIZE_HELP,
    choices_arg,
    float_arg,
    ints_arg,
    readable,
    size_arg,
)
from sparsecoll.benchmarks.model import (
    AUTO_CANDIDATES,
    FORMULAS,
    LINKS,
    Calibrated,
    Link,
    Problem,
    calibrate,
    check_messages,
    read_rows,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from emulate_cluster import parse_rate, rate_arg

VALUE_BYTES = {"float16": 2, "float32": 4, "float64": 8}


def problem_of(rows: list[dict], n: int) -> Problem:
    r = next(r for r in rows if r["n"] == n)
    return Problem(
        n=n,
        k=r["k"],
        index_bytes=4 if n <= 2**31 else 8,
        value_bytes=VALUE_BYTES[r["dtype"]],
        overlap=r["overlap"],
        ranks=int(r["P"]),
    )


def fit_alpha(shm: list[dict], emu: list[dict]) -> float | None:
    """Per-message latency of the emulated link from its smallest size (bytes negligible)."""
    if not emu:
        return None
    n0 = min(r["n"] for r in emu)
    base = {(r["algorithm"], r["P"]): r for r in shm if r["n"] == n0}
    est = []
    for r in emu:
        b = base.get((r["algorithm"], r["P"]))
        msgs = r["messages_per_rank"] + r["meta_messages_per_rank"] + check_messages(r["P"])
        if r["n"] == n0 and b and msgs:
            est.append(max(0.0, (r["median_us"] - b["median_us"]) * 1e-6 / msgs))
    if not est:
        return None
    q = statistics.quantiles(est, n=4) if len(est) > 1 else [est[0]] * 3
    print(
        f"\nα fit: {len(est)} estimates at n = {n0}, quartiles "
        f"{', '.join(f'{v * 1e6:.0f}' for v in q)} µs"
    )
    return statistics.median(est)


def counts_table(cals: dict[str, Calibrated]) -> list[str]:
    out = [
        "| algorithm | P | bytes/rank measured | formula | ratio | messages measured | "
        "formula | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, cal in cals.items():
        for P in sorted(p for p in cal.measured if p > 1):
            r = cal.measured[P]
            f = FORMULAS[name](P, cal.problem)
            m = r["messages_per_rank"] + r["meta_messages_per_rank"]
            out.append(
                f"| {name} | {P} | {r['bytes_per_rank']} | {f.bytes:.0f} | "
                f"{r['bytes_per_rank'] / f.bytes if f.bytes else 0:.3f} | {m} | "
                f"{f.messages:.0f} | {m / f.messages if f.messages else 0:.2f} |"
            )
    return out


def measured_table(rows: list[dict], n: int, rate: float) -> list[str]:
    """Measured latency per P next to dense and to the wire-time limit (bytes sent / rate)."""
    ps = sorted({r["P"] for r in rows if r["n"] == n})
    by = {(r["algorithm"], r["P"]): r for r in rows if r["n"] == n}
    names = sorted({a for a, _ in by}, key=lambda a: (a != "dense", a))
    head = "| algorithm | " + " | ".join(
        f"P={P} ms | ×dense | bytes/rank | wire ms | ×wire" for P in ps
    )
    out = [head + " |", "|---|" + "---|---|---|---|---|" * len(ps)]
    for a in names:
        cells = []
        for P in ps:
            r = by.get((a, P))
            if r is None:
                cells.append(" | | | | ")
                continue
            t, b = r["median_us"] / 1e3, r["bytes_per_rank"]
            wire = b / rate * 1e3
            d = by.get(("dense", P))
            x = f"{d['median_us'] / r['median_us']:.1f}" if d else "-"
            cells.append(f"{t:.0f} | {x} | {b} | {wire:.1f} | {t / wire if wire else 0:.1f}")
        out.append(f"| {a} | " + " | ".join(cells) + " |")
    return out


def link_check(csv_paths: list[str], log_paths: list[str]) -> list[str]:
    """Payload the Communicator counted vs bytes the capped links carried, per emulated run."""
    out = [
        "| run | payload sent per rank (GB) | link tx per host (GB) | link / payload |",
        "|---|---|---|---|",
    ]
    for path, log in zip(sorted(csv_paths), sorted(log_paths)):
        rows = read_rows([path])
        payload = sum(
            float(r["bytes_per_rank_avg"]) * (r["iterations"] + int(r["warmup"])) for r in rows
        )
        tx = [
            int(line.split()[2])
            for line in Path(log).read_text().splitlines()
            if line.startswith("[emulate] scemu-h")
        ]
        if tx and payload:
            mean = sum(tx) / len(tx)
            out.append(
                f"| {Path(path).name} | {payload / 1e9:.3f} | {mean / 1e9:.3f} | "
                f"{mean / payload:.3f} |"
            )
    return out


def validate(
    cals: dict[str, Calibrated], shm: list[dict], emu: list[dict], n: int, link: Link
) -> tuple[list[str], list[float]]:
    base = {(r["algorithm"], r["P"]): r for r in shm if r["n"] == n}
    out = [
        "| algorithm | P | measured (ms) | model (ms) | α·M | S/B | local (shm) | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    errors = []
    for r in sorted((r for r in emu if r["n"] == n), key=lambda r: (r["algorithm"], r["P"])):
        b = base.get((r["algorithm"], r["P"]))
        if b is None:
            continue
        msgs = r["messages_per_rank"] + r["meta_messages_per_rank"] + check_messages(r["P"])
        a, s = link.alpha * msgs, r["bytes_per_rank"] / link.bandwidth
        local = b["median_us"] * 1e-6
        model = a + s + local
        meas = r["median_us"] * 1e-6
        err = (model - meas) / meas
        errors.append(err)
        out.append(
            f"| {r['algorithm']} | {r['P']} | {meas * 1e3:.1f} | {model * 1e3:.1f} | "
            f"{a * 1e3:.2f} | {s * 1e3:.1f} | {local * 1e3:.1f} | {err * 100:+.0f}% |"
        )
    return out, errors


def project(
    cals: dict[str, Calibrated], link: Link, ps: list[int], auto: bool, local: bool = True
) -> list[str]:
    """Projected ms per algorithm and P (with the speedup vs dense in parentheses)."""
    times = {name: {P: cal.time(P, link, local) for P in ps} for name, cal in cals.items()}
    cands = [a for a in AUTO_CANDIDATES if a in times]
    if auto and cands:
        times["auto (best exact)"] = {P: min(times[a][P] for a in cands) for P in ps}
    dense = times.get("dense")
    out = ["| algorithm | " + " | ".join(f"P = {P}" for P in ps) + " |", "|---|" + "---|" * len(ps)]
    for name, row in times.items():
        cells = []
        for P in ps:
            x = f" ({dense[P] / row[P]:.1f}×)" if dense and name != "dense" else ""
            cells.append(f"{row[P] * 1e3:.1f}{x}")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=SIZE_HELP)
    p.add_argument(
        "--shm", type=readable, nargs="+", required=True, help="shared-memory CSVs (P=1,2,...)"
    )
    p.add_argument("--emulated", type=readable, nargs="*", default=[], help="emulated-cluster CSVs")
    p.add_argument(
        "--emu-rate", type=rate_arg, default="1gbit", help="emulated link rate (tc syntax)"
    )
    p.add_argument(
        "--emu-logs",
        type=readable,
        nargs="*",
        default=[],
        help="stderr of the emulated runs (link byte counters), same order",
    )
    p.add_argument("--emu-alpha", type=float_arg(0), default=None, help="emulated α in seconds")
    p.add_argument(
        "-n",
        type=size_arg,
        default=None,
        help="dense length to model (default: the "
        "largest in the emulated files, else in the shm files)",
    )
    p.add_argument(
        "--P", type=ints_arg(1), default="8,16,32,64,128,256,512,1024", help="projected P values"
    )
    p.add_argument(
        "--links",
        type=choices_arg(LINKS, "link preset"),
        default=",".join(LINKS),
        help="link presets to project on",
    )
    args = p.parse_args(argv)
    shm, emu = read_rows(args.shm), read_rows(args.emulated)
    if not shm:  # (max() of no rows: a ValueError traceback)
        p.error(f"no rows in --shm {' '.join(map(str, args.shm))}")
    n = args.n or max(r["n"] for r in (emu or shm))
    if not any(r["n"] == n for r in shm):  # (a StopIteration traceback in problem_of)
        p.error(f"n = {n} is not in the --shm files: they have {sorted({r['n'] for r in shm})}")
    prob = problem_of(shm, n)
    names = sorted({r["algorithm"] for r in shm if r["n"] == n})
    cals = {a: calibrate(a, prob, shm + emu) for a in names if a in FORMULAS}
    skipped = [a for a in names if a not in FORMULAS and a != "auto"]
    print(
        f"## Model inputs\n\nn = {n}, k = {prob.k} per rank, {prob.pair}-byte pairs, "
        f"overlap {prob.overlap}"
        + (f"; no formula (not projected): {skipped}" if skipped else "")
        + "\n"
    )
    print("| algorithm | bytes factor | messages factor | c0 (ms) | c1 (ns/byte) |")
    print("|---|---|---|---|---|")
    for a, c in cals.items():
        print(
            f"| {a} | {c.bytes_factor:.3f} | {c.messages_factor:.2f} | {c.c0 * 1e3:.1f} | "
            f"{c.c1 * 1e9:.2f} |"
        )
    print("\n## Counts: formulas vs the Communicator\n")
    print("\n".join(counts_table(cals)))
    errors: list[float] = []
    if emu:
        rate = parse_rate(args.emu_rate) / 8
        print(f"\n## Measured on the emulated cluster ({args.emu_rate}), median ms\n")
        print("\n".join(measured_table(emu, n, rate)))
        if args.emu_logs:
            print("\n## Traffic on the capped links (every call of every algorithm)\n")
            print("\n".join(link_check(args.emulated, args.emu_logs)))
        alpha = args.emu_alpha if args.emu_alpha is not None else fit_alpha(shm, emu)
        link = Link(f"emulated {args.emu_rate}", alpha or 0.0, parse_rate(args.emu_rate) / 8)
        print(
            f"\n## Validation on the emulated cluster ({link.name}, α = "
            f"{link.alpha * 1e6:.0f} µs{' fitted' if args.emu_alpha is None else ''})\n"
        )
        table, errors = validate(cals, shm, emu, n, link)
        print("\n".join(table))
        if errors:
            abs_err = sorted(abs(e) for e in errors)
            print(
                f"\nmedian |error| {statistics.median(abs_err) * 100:.0f}%, "
                f"max |error| {abs_err[-1] * 100:.0f}% over {len(errors)} points"
            )
    ps = args.P
    for key in args.links:
        link = LINKS[key]
        for local, what in ((False, "network time α·M + S/B"), (True, "with local work C(P)")):
            print(
                f"\n## Projected latency, ms (speedup vs dense), {link.name} (α = "
                f"{link.alpha * 1e6:g} µs, B = {link.bandwidth / 1e9:g} GB/s): {what}\n"
            )
            print("\n".join(project(cals, link, ps, "auto" in names, local)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
