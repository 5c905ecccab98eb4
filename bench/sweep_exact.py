"""Sweep the exact sparse allreduce algorithms: latency and bytes per rank.

Grid: P × n × density × overlap pattern (``sparsecoll.benchmarks.problems``), every
exact algorithm in the registry (and auto) on the same inputs, each result checked against
``dense`` (timed only when ``--algorithms`` names it; else one untimed call).

    python bench/sweep_exact.py --np 2,4,8            # relaunches itself per P
    mpiexec -n 4 python bench/sweep_exact.py          # one P
    python bench/sweep_exact.py --np 2,4 -n 64K --density 0.01 --summary cases.csv

Columns: median/min/max latency over iterations (each the slowest rank's time), bytes sent
per rank per call (the most any rank sent; payload only, counts and other metadata apart),
that figure relative to dense, the result's nnz, whether it matched dense, and auto's picks
in the timed calls (``NAMExCOUNT`` each where they differ). Each algorithm is one instance,
reused for the warm-up and the timed calls (auto first measures its contenders, in calls
added to the warm-up, so that its pick then has ``-x`` untimed calls as any other).
``--rounds R`` (R > 1) builds and warms up every instance first, then times R rounds in
which each algorithm runs a block of ``-i`` calls, in an order rotated by one
each round (a drift of the link over the run is then spread across all of them, and no
algorithm always follows the same one); each row reports all its R × ``-i`` calls.

After each case a ``# case`` line names the fastest exact algorithm (by median; auto
apart), auto's most frequent pick and auto's median over the fastest's; ``--summary``
writes those lines as CSV (appended to by each P of ``--np``), and the run ends with how
many cases auto was within 10% of the fastest.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys

import numpy as np

SWEPT = ("random", "same", "disjoint", "skewed", "hot", "zipf")  # default --overlap
SUMMARY = ("P", "n", "density", "overlap", "fastest", "fastest_ms", "auto_choice", "auto_ms")
SUMMARY += ("auto_ratio",)
COLUMNS = (
    "P",
    "n",
    "density",
    "overlap",
    "algorithm",
    "median_ms",
    "min_ms",
    "max_ms",
    "bytes_per_rank",
    "vs_dense",
    "result_nnz",
    "correct",
    "note",
)


def parse(argv: list[str] | None) -> argparse.Namespace:
    from sparsecoll.benchmarks.cli import (
        SIZE_HELP,
        RankZeroParser,
        algorithm_kind,
        choices_arg,
        densities_arg,
        int_arg,
        ints_arg,
        out_arg,
        parse_algorithms,
        sizes_arg,
        wire_variants,
    )
    from sparsecoll.benchmarks.problems import OVERLAPS
    from sparsecoll.registry import available_algorithms

    p = RankZeroParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, epilog=SIZE_HELP
    )
    p.add_argument("--np", type=ints_arg(1), default=None, help="launch for each P (e.g. 2,4,8)")
    p.add_argument("-n", type=sizes_arg, default=[2**20, 2**24], help="dense lengths (1M,16M)")
    p.add_argument("--density", type=densities_arg, default=[0.001, 0.01, 0.1])
    p.add_argument(
        "--overlap",
        type=choices_arg(OVERLAPS, "overlap"),
        default=",".join(SWEPT),
        help="comma-separated patterns (default: %(default)s)",
    )
    p.add_argument(
        "--algorithms",
        default="all",
        help="comma-separated exact algorithms, NAME:compact for the compact wire ('all', "
        "the default: every exact one, with its compact wire where it takes one)",
    )
    p.add_argument("--dtype", default="float32", choices=("float16", "float32", "float64"))
    p.add_argument("-i", "--iterations", type=int_arg(1), default=5)
    p.add_argument("-x", "--warmup", type=int_arg(0), default=1)
    p.add_argument(
        "--rounds", type=int_arg(1), default=1, help="blocks of -i calls of each, in turn"
    )
    p.add_argument("--format", choices=("table", "csv"), default="table")
    p.add_argument("--summary", type=out_arg(), default=None, help="per-case CSV (appended)")
    p.add_argument("--no-header", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:  # (an unknown name failed on every rank in its first call, with a traceback)
        known = wire_variants(available_algorithms())
        names = parse_algorithms([args.algorithms], known, "--algorithms")
    except ValueError as exc:
        p.error(str(exc))  # every rank parses the same argv: all exit alike
    # (a selecting algorithm ran, was marked NO against dense and made the sweep exit 1)
    exact = [name for name in known if algorithm_kind(name).exact]
    named = [t.strip() for t in args.algorithms.split(",")]
    for name in names:
        if name in named and name not in exact:
            p.error(
                f"argument --algorithms: {name!r} selects (it is not exact); "
                f"an exact sweep takes {', '.join(exact)}"
            )
    if args.algorithms == "all":  # every exact one, its compact wire too (auto weighs it)
        names = exact
    args.algorithms = [name for name in names if name in exact]
    return args


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    from sparsecoll._launch import mpiexec_command

    rest = []
    skip = False
    for a in argv:  # drop --np and its value
        if skip:
            skip = False
            continue
        if a == "--np":
            skip = True
            continue
        if not a.startswith("--np="):
            rest.append(a)
    rc = 0
    for i, P in enumerate(args.np):
        cmd = [*mpiexec_command(P), sys.executable, os.path.abspath(__file__), *rest]
        if i:
            cmd.append("--no-header")
        rc |= subprocess.call(cmd)
    return rc


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.np:
        return launch(args, argv)
    from sparsecoll import __version__, allreduce
    from sparsecoll.benchmarks.main import run_algorithm
    from sparsecoll.benchmarks.problems import make_problem
    from sparsecoll.comm import Communicator, mpi_library_version

    comm = Communicator()
    P = comm.size
    names = args.algorithms
    dtype = np.dtype(args.dtype)
    out = sys.stdout if comm.rank == 0 else None
    if out and not args.no_header:
        print(f"# sparsecoll {__version__} exact sweep: {mpi_library_version()}", file=out)
        load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
        print(f"# P={P} on {os.cpu_count()} cores, load average {load} at start", file=out)
        rounds = f"rounds={args.rounds} " if args.rounds > 1 else ""
        print(
            f"# dtype={dtype} iterations={args.iterations} warmup={args.warmup} {rounds}"
            f"latency = slowest rank per call; bytes = most any rank sent per call",
            file=out,
        )
        if args.format == "csv":
            print(",".join(COLUMNS), file=out)
        else:
            print(
                f"{'P':>2} {'n':>9} {'density':>7} {'overlap':>8} {'algorithm':>18} "
                f"{'median ms':>10} {'min ms':>9} {'max ms':>9} {'bytes/rank':>11} "
                f"{'vs dense':>8} {'nnz':>9} {'ok':>3} note",
                file=out,
            )
        out.flush()
    # one tiny call of each first: imports, MPI connections and JIT caches are not timed
    tiny_vals, tiny_idx = make_problem(4096, 0.01, comm.rank, P, "random", dtype)
    for name in names:
        run_algorithm(comm, name, tiny_vals, tiny_idx, 4096, 41, 1, 0)
    ok_all = True
    cases = []
    for n in args.n:
        for density in args.density:
            for overlap in args.overlap:
                vals, idx = make_problem(n, density, comm.rank, P, overlap, dtype)
                k = round(density * n)
                reference = None
                dense_bytes = None
                medians, choice = {}, ""
                run = ["dense", *[a for a in names if a != "dense"]]
                if "dense" not in names:  # (the reference alone: one call, not timed)
                    reference = allreduce(comm, vals, idx, n=n, algorithm="dense")
                    dense_bytes = int(
                        comm.allreduce_ints([reference.info["stats"].bytes_sent], "max")[0]
                    )
                    run = run[1:]
                for name, (res, times, sent, picks) in zip(
                    run, measure(comm, run, vals, idx, n, k, args)
                ):
                    sent = int(comm.allreduce_ints([sent], "max")[0])
                    if name == "dense":
                        reference, dense_bytes = res, sent
                    good = matches(res, reference)
                    good = bool(comm.allreduce_ints([0 if good else 1], "max")[0] == 0)
                    ok_all &= good
                    if name not in names:
                        continue
                    medians[name] = float(np.median(times))
                    note = describe_picks(picks)
                    choice = (picks and max(picks, key=picks.count)) or choice
                    row = (
                        P,
                        n,
                        density,
                        overlap,
                        name,
                        np.median(times) * 1e3,
                        min(times) * 1e3,
                        max(times) * 1e3,
                        sent,
                        sent / dense_bytes if dense_bytes else float("nan"),
                        res.nnz,
                        "yes" if good else "NO",
                        note,
                    )
                    if out:
                        if args.format == "csv":
                            print(",".join(_fmt(v) for v in row), file=out)
                        else:
                            print(
                                f"{P:>2} {n:>9} {density:>7.3%} {overlap:>8} {name:>18} "
                                f"{row[5]:>10.2f} {row[6]:>9.2f} {row[7]:>9.2f} {sent:>11} "
                                f"{row[9]:>8.3f} {res.nnz:>9} {row[11]:>3} {note}",
                                file=out,
                            )
                        out.flush()
                del vals, idx, reference
                case = summarize(P, n, density, overlap, medians, choice)
                if case:
                    cases.append(case)
                    if out:
                        print(f"# case {describe(case)}", file=out, flush=True)
    if out and cases:
        report(cases, args, out)
    return 0 if ok_all else 1


def measure(comm, names: list[str], vals, idx, n: int, k: int, args: argparse.Namespace):
    """Each algorithm's (last result, times, bytes sent, picks) as ``run_algorithm`` gives
    them, in the order of ``names``: one after another, or in ``--rounds`` (built and warmed
    up first, then each round's blocks in an order rotated by one)."""
    from sparsecoll.benchmarks.cli import build
    from sparsecoll.benchmarks.main import run_algorithm, time_calls

    if args.rounds == 1:  # (lazily: each row printed as soon as it is measured)
        for name in names:
            yield run_algorithm(comm, name, vals, idx, n, k, args.iterations, args.warmup)
        return
    algos = {name: build(name, n, k) for name in names}
    for algo in algos.values():  # settle_calls and -x untimed calls, as run_algorithm's
        calls = algo.settle_calls + args.warmup
        if calls:
            time_calls(comm, [algo] * calls, vals, idx, n, skip=calls)
    last, times, picks = {}, {a: [] for a in names}, {a: [] for a in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            last[name] = None  # (its previous result freed before the barrier)
            last[name] = time_calls(comm, [algos[name]] * args.iterations, vals, idx, n)
            times[name] += last[name].times
            picks[name] += last[name].picks
    for name in names:
        slowest = comm.allreduce_floats(times[name], "max").tolist()
        yield last[name].result, slowest, last[name].stats.bytes_sent, picks[name]


def describe_picks(picks: list[str]) -> str:
    """auto's picks over the timed calls: one name, or each with its count."""
    names = list(dict.fromkeys(picks))
    if len(names) <= 1:
        return "".join(names)
    return " ".join(f"{p}x{picks.count(p)}" for p in names)


def summarize(P, n, density, overlap, medians: dict, choice: str) -> dict | None:
    """The fastest exact algorithm of a case (auto apart) and auto's ratio to it."""
    fixed = {a: t for a, t in medians.items() if a != "auto"}
    if not fixed:
        return None
    best = min(fixed, key=fixed.get)
    auto = medians.get("auto")
    return {
        "P": P,
        "n": n,
        "density": density,
        "overlap": overlap,
        "fastest": best,
        "fastest_ms": fixed[best] * 1e3,
        "auto_choice": choice,
        "auto_ms": "" if auto is None else auto * 1e3,
        "auto_ratio": "" if auto is None or not fixed[best] else auto / fixed[best],
    }


def describe(c: dict) -> str:
    text = (
        f"P={c['P']} n={c['n']} density={c['density']:.3%} {c['overlap']}: fastest "
        f"{c['fastest']} {c['fastest_ms']:.3f} ms"
    )
    if c["auto_choice"]:
        text += f"; auto picked {c['auto_choice']}, {c['auto_ratio']:.2f}x the fastest"
    return text


def report(cases: list[dict], args: argparse.Namespace, out) -> None:
    """The per-case CSV (--summary) and how often auto was within 10% of the fastest."""
    if args.summary:
        with open(args.summary, "a" if args.no_header else "w", newline="") as f:
            w = csv.DictWriter(f, SUMMARY)
            if not args.no_header:
                w.writeheader()
            w.writerows({k: _fmt(v) for k, v in c.items()} for c in cases)
    timed = [c for c in cases if c["auto_ratio"] != ""]
    if timed:
        near = sum(c["auto_ratio"] <= 1.1 for c in timed)
        picked = sum(c["auto_choice"] == c["fastest"] for c in timed)
        worst = max(timed, key=lambda c: c["auto_ratio"])
        print(
            f"# auto within 10% of the fastest in {near} of {len(timed)} cases, picked the "
            f"fastest in {picked}; worst {describe(worst)}",
            file=out,
            flush=True,
        )


def matches(result, reference) -> bool:
    """Whether an exact result equals dense's, dropping exact zeros (dense drops them), in
    linear time (both are sorted)."""
    ri, rv = np.asarray(result.indices), np.asarray(result.values, dtype=np.float64)
    ei, ev = np.asarray(reference.indices), np.asarray(reference.values, dtype=np.float64)
    keep = rv != 0
    ri, rv = ri[keep], rv[keep]
    if ri.shape != ei.shape or not np.array_equal(ri, ei):
        return False
    eps = float(np.finfo(result.values.dtype).eps)
    scale = float(np.max(np.abs(ev), initial=0.0))
    return bool(np.all(np.abs(rv - ev) <= 64 * eps * (np.abs(ev) + scale)))


def _fmt(v: object) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    sys.exit(main())
