"""OSU-style latency sweep of sparse allreduce: every algorithm, a range of sizes, vs dense.

Run under mpiexec (``python -m sparsecoll bench osu --np 4 ...`` relaunches itself, as does
``bench/osu_sparse_allreduce.py``). For each dense length n (``-m MIN:MAX``, doubling) every
rank builds its input with :func:`sparsecoll.benchmarks.problems.make_problem` (density·n
nonzeros, ``--overlap`` pattern), then each algorithm is timed as OSU times a collective:
``-x`` warm-up calls, then ``-i`` timed calls, each after a barrier, with ``MPI.Wtime``;
a call's latency is its slowest rank's time, and avg/min/max/median (``-f`` prints min and
max) are taken over the ``-i`` calls, all from those same samples. (OSU's ``-f`` reports
instead the min/max over ranks of each rank's average; ours is the collective's time as
the job sees it.) ``Size`` is the dense vector in bytes (n elements of ``--dtype``), as
OSU's message size; ``n`` has its own column. ``dense`` (MPI_Allreduce) always runs, as
the baseline of ``Speedup vs dense`` (dense avg latency / this avg latency: > 1 means
faster than dense; CSV ``speedup_vs_dense``; CSV ``bytes_vs_dense`` is the byte ratio).
``Bytes/rank`` is the payload one call sends per rank (the max over ranks), exact, from
the Communicator's counters. ``--table`` prints one table for every algorithm (a row per
size, an avg latency and a bytes column per algorithm) instead of one per algorithm. Only
rank 0 prints; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
import time
from typing import Any

import numpy as np

from .. import __version__
from .._array import cupy_or_none
from ..algorithms.base import reference_sum
from ..comm import Communicator, mpi_library_version
from ..errors import SparseCollError
from .cli import (
    add_input_arguments,
    add_timing_arguments,
    algorithm_kind,
    bench_parser,
    parse_algorithms,
    parse_checked,
    parse_sizes,
    sizes_arg,
)
from .main import gather_inputs, time_algorithm, verify_all
from .problems import make_problem

__all__ = [
    "FIELDS",
    "build_parser",
    "latency_stats",
    "main",
    "parse_algorithms",
    "parse_args",
    "parse_sizes",
    "run",
]

BASELINE = "dense"
FIELDS = (
    "algorithm",
    "exact",
    "P",
    "n",
    "size_bytes",
    "density",
    "k",
    "overlap",
    "dtype",
    "device",
    "iterations",
    "warmup",
    "avg_us",
    "min_us",
    "max_us",
    "median_us",
    "bytes_per_rank",
    "bytes_per_rank_avg",
    "bytes_recv_per_rank",
    "messages_per_rank",
    "meta_bytes_per_rank",
    "meta_messages_per_rank",
    "result_nnz",
    "speedup_vs_dense",
    "bytes_vs_dense",
    "valid",
    "error",
)


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser(
        "python -m sparsecoll bench osu", __doc__, "Example: -m 1M:64M --density 0.01 -c"
    )
    p.add_argument(
        "-m",
        "--message-size",
        type=sizes_arg,
        default="1M:16M",
        metavar="MIN:MAX",
        help="dense lengths n, in elements: MIN:MAX doubling, N, or a comma list (default 1M:16M)",
    )
    add_timing_arguments(p, 10, 2, timed="timed calls per size")
    p.add_argument(
        "-f",
        "--full",
        action="store_true",
        help="full stats: min and max latency over the timed calls",
    )
    p.add_argument(
        "-d",
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the buffers live (cuda: CuPy arrays)",
    )
    p.add_argument(
        "-c",
        "--validate",
        action="store_true",
        help="check every result: exact algorithms against the dense sum, selecting ones "
        "against their contract (the algorithm's verify())",
    )
    add_input_arguments(p)
    p.add_argument("--format", choices=("text", "csv", "json"), default="text")
    p.add_argument(
        "--reuse",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one algorithm instance for all calls of a size, as training uses them: the "
        "steady state of stateful algorithms (default); --no-reuse: a fresh instance per call",
    )
    p.add_argument(
        "--table",
        action="store_true",
        help="text format: one comparison table, a row per size and an avg latency and a "
        "bytes column per algorithm (default: a table per algorithm)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the arguments (usage errors exit 2, printed by rank 0 only)."""
    return parse_checked(build_parser(), argv)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run (under mpiexec)."""
    return run(parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """The sweep on parsed arguments; rank 0 prints. Exit code 1 when a row failed."""
    sizes, names = args.message_size, args.algorithm
    comm = Communicator()
    xp = np
    if args.device == "cuda":
        xp = cupy_or_none()
        if comm.allreduce_ints([xp is None], "max")[0]:
            if comm.rank == 0:
                print(
                    "error: -d cuda needs CuPy and a CUDA device on every rank "
                    "(pip install 'sparsecoll[gpu]')",
                    file=sys.stderr,
                )
            return 2
    rows = run_sweep(comm, args, sizes, names, xp)
    if comm.rank == 0:
        sys.stdout.write(render(rows, args, comm.size, names))
        sys.stdout.flush()
    return 0 if all(r["valid"] != "no" and not r["error"] for r in rows) else 1


def run_sweep(comm: Communicator, args: Any, sizes: list[int], names: list[str], xp: Any):
    """Time every (size, algorithm); return the rows (identical on every rank)."""
    order = [BASELINE, *(a for a in names if a != BASELINE)]
    total = len(sizes) * len(order)
    dtype = np.dtype(args.dtype)
    rows = []
    t_start = time.monotonic()
    step = 0
    for n in sizes:
        k = round(args.density * n)
        vals, idx = make_problem(n, args.density, comm.rank, comm.size, args.overlap, dtype)
        inputs = gather_inputs(comm, vals, idx, n) if args.validate else None
        # the sum every result is checked against, dense's included: not any algorithm's
        reference = reference_sum(inputs) if args.validate else None
        if xp is not np:
            vals, idx = xp.asarray(vals), xp.asarray(idx)
        for name in order:
            step += 1
            t0 = time.monotonic()
            row = measure(comm, args, name, vals, idx, n, k, dtype)
            result = row.pop("_result")
            if name == BASELINE:
                base = row
            if args.validate and result is not None:
                ok = verify_all(comm, name, result, reference, inputs, n, k)
                row["valid"] = "yes" if ok else "no"
            del result
            if base["avg_us"] and row["avg_us"]:
                row["speedup_vs_dense"] = round(base["avg_us"] / row["avg_us"], 4)
            if base["bytes_per_rank"]:
                row["bytes_vs_dense"] = round(row["bytes_per_rank"] / base["bytes_per_rank"], 6)
            if name in names:
                rows.append(row)
            if comm.rank == 0 and not args.quiet:
                done = time.monotonic() - t_start
                eta = done / step * (total - step)
                status = row["error"] or f"avg {row['avg_us'] / 1e3:.2f} ms"
                print(
                    f"[osu] {step}/{total} n={n} {name}: {status} "
                    f"({time.monotonic() - t0:.1f} s; elapsed {done:.0f} s, "
                    f"~{eta:.0f} s left)",
                    file=sys.stderr,
                    flush=True,
                )
        del vals, idx, reference, inputs
    return rows


def measure(
    comm: Communicator, args: Any, name: str, vals: Any, idx: Any, n: int, k: int, dtype: np.dtype
) -> dict[str, Any]:
    """One row: latency over ranks, bytes and messages per rank (max over ranks)."""
    row: dict[str, Any] = dict.fromkeys(FIELDS, "")
    row.update(
        algorithm=name,
        exact=algorithm_kind(name).exact,
        P=comm.size,
        n=n,
        size_bytes=n * dtype.itemsize,
        density=args.density,
        k=k,
        overlap=args.overlap,
        dtype=str(dtype),
        device=args.device,
        iterations=args.iterations,
        warmup=args.warmup,
        avg_us=0.0,
        _result=None,
    )
    try:
        t = time_algorithm(
            comm, name, vals, idx, n, k, args.iterations, args.warmup, reuse=args.reuse
        )
    except SparseCollError as exc:  # raised alike on every rank (collective checks)
        row["error"] = f"{type(exc).__name__}: {exc}"
        row["avg_us"] = 0.0
        return row
    per_iter = comm.allreduce_floats(t.times, "max")  # a call lasts as long as its slowest rank
    s = t.stats
    counts = [s.bytes_sent, s.bytes_recv, s.messages_sent, s.meta_bytes_sent, s.meta_messages_sent]
    mx = comm.allreduce_ints(counts, "max")
    sent_sum = int(comm.allreduce_ints([s.bytes_sent], "sum")[0])
    row.update(
        **latency_stats(per_iter),
        bytes_per_rank=int(mx[0]),
        bytes_per_rank_avg=sent_sum / comm.size,
        bytes_recv_per_rank=int(mx[1]),
        messages_per_rank=int(mx[2]),
        meta_bytes_per_rank=int(mx[3]),
        meta_messages_per_rank=int(mx[4]),
        result_nnz=t.result.nnz,
        _result=t.result,
    )
    return row


def latency_stats(per_iter: Any) -> dict[str, float]:
    """avg/min/max/median latency (µs) of one set of samples: each timed call's slowest rank.

    All four come from the same samples, so min <= median <= max and min <= avg <= max.
    """
    t = np.asarray(per_iter, dtype=np.float64)
    return {
        "avg_us": _us(np.mean(t)),
        "min_us": _us(np.min(t)),
        "max_us": _us(np.max(t)),
        "median_us": _us(np.median(t)),
    }


def _us(seconds: float) -> float:
    return round(float(seconds) * 1e6, 3)


def render(rows: list[dict[str, Any]], args: Any, nprocs: int, names: list[str]) -> str:
    """The rows as text (OSU's shape), CSV or JSON."""
    out = io.StringIO()
    if args.format == "csv":
        w = csv.DictWriter(out, fieldnames=FIELDS, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
        return out.getvalue()
    header = {
        "test": "sparsecoll OSU-style sparse allreduce latency test",
        "version": __version__,
        "mpi_library": mpi_library_version(),
        "P": nprocs,
        "density": args.density,
        "overlap": args.overlap,
        "dtype": args.dtype,
        "device": args.device,
        "iterations": args.iterations,
        "warmup": args.warmup,
        "reuse": args.reuse,
    }
    if args.format == "json":
        return json.dumps({"header": header, "results": rows}, indent=1) + "\n"
    if args.table:
        return render_table(rows, args, header, names)
    for name in names:
        sel = [r for r in rows if r["algorithm"] == name]
        kind = "exact" if algorithm_kind(name).exact else "selecting"
        print(f"# {header['test']} v{__version__}", file=out)
        print(f"# MPI library: {header['mpi_library']}", file=out)
        print(
            f"# P: {nprocs}, algorithm: {name} ({kind}), density: {args.density}, "
            f"overlap: {args.overlap}, dtype: {args.dtype}, device: {args.device}"
            f"{', reused instance' if args.reuse else ''}",
            file=out,
        )
        print(
            f"# Size: bytes of the dense vector (n x {np.dtype(args.dtype).itemsize} B); "
            f"Latency: each timed call's slowest rank, {'avg/min/max' if args.full else 'avg'}"
            f" over the {args.iterations} timed calls",
            file=out,
        )
        print(
            "# Speedup vs dense: dense Avg Latency / this Avg Latency (> 1: faster)"
            + ("; Validation: against the dense sum" if args.validate and kind == "exact" else "")
            + ("; Validation: against its contract" if args.validate and kind != "exact" else ""),
            file=out,
        )
        cols = f"{'# Size':<14}{'n':>12}{'Avg Latency(us)':>18}"
        if args.full:
            cols += f"{'Min Latency(us)':>18}{'Max Latency(us)':>18}{'Iterations':>12}"
        cols += f"{'Bytes/rank':>14}{'Speedup vs dense':>18}"
        if args.validate:
            cols += f"{'Validation':>12}"
        print(cols, file=out)
        for r in sel:
            if r["error"]:
                print(f"{r['size_bytes']:<14}{r['n']:>12}  error: {r['error']}", file=out)
                continue
            line = f"{r['size_bytes']:<14}{r['n']:>12}{r['avg_us']:>18.2f}"
            if args.full:
                line += f"{r['min_us']:>18.2f}{r['max_us']:>18.2f}{r['iterations']:>12}"
            speed = r["speedup_vs_dense"]
            line += f"{r['bytes_per_rank']:>14}{(f'{speed:.2f}x' if speed else '-'):>18}"
            if args.validate:
                line += f"{'Pass' if r['valid'] == 'yes' else 'FAIL':>12}"
            print(line, file=out)
        print(file=out)
    return out.getvalue()


def render_table(
    rows: list[dict[str, Any]], args: Any, header: dict[str, Any], names: list[str]
) -> str:
    """The rows as one OSU-style text table: a row per size, per algorithm its avg latency
    (``name(us)``) and bytes per rank (``name(B)``); failed checks in a last column."""
    out = io.StringIO()
    instance = "one instance reused per size" if args.reuse else "a fresh instance per call"
    print(f"# {header['test']} v{__version__}", file=out)
    print(f"# MPI library: {header['mpi_library']}", file=out)
    print(
        f"# P: {header['P']}, algorithms: {', '.join(names)}, density: {args.density}, "
        f"overlap: {args.overlap}, dtype: {args.dtype}, device: {args.device}, {instance}",
        file=out,
    )
    print(
        f"# Size: bytes of the dense vector (n x {np.dtype(args.dtype).itemsize} B); "
        f"NAME(us): avg latency over the {args.iterations} timed calls, each its slowest "
        f"rank's; NAME(B): payload bytes sent per rank per call (max over ranks)",
        file=out,
    )
    widths = {name: max(12, len(name) + 6) for name in names}
    cols = f"{'# Size':<14}{'n':>12}"
    cols += "".join(f"{f'{a}(us)':>{widths[a]}}{f'{a}(B)':>{widths[a]}}" for a in names)
    print(cols + (f"  {'Validation'}" if args.validate else ""), file=out)
    for n in dict.fromkeys(r["n"] for r in rows):
        at = {r["algorithm"]: r for r in rows if r["n"] == n}
        line = f"{next(iter(at.values()))['size_bytes']:<14}{n:>12}"
        for a in names:
            r, w = at[a], widths[a]
            cells = ("error", "-") if r["error"] else (f"{r['avg_us']:.2f}", r["bytes_per_rank"])
            line += f"{cells[0]:>{w}}{cells[1]:>{w}}"
        if args.validate:
            bad = [a for a in names if at[a]["valid"] == "no" or at[a]["error"]]
            line += f"  {'FAIL: ' + ','.join(bad) if bad else 'Pass'}"
        print(line, file=out)
    return out.getvalue()
