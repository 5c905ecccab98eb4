"""Weak scaling of sparse allreduce: fixed k per rank, P growing (the Ok-Topk paper's figure).

For each P the script relaunches itself under ``mpiexec -n P``; every rank holds k = density·n
random (overlapping) nonzeros. Per algorithm it reports the median latency over iterations
(max over ranks), the payload bytes sent and received per rank (max over ranks) and the
metadata bytes, and whether the result met the algorithm's contract (``verify``).

Stateful algorithms (oktopk) reuse one instance over the iterations: the rows show the steady
state (threshold and regions reused). ``oktopk/first`` builds a fresh instance per call, so
every call repartitions and recomputes the threshold exactly.

    python bench/weak_scaling.py                       # P = 2, 4, 8, 16; n = 4M; 1%
    python bench/weak_scaling.py --np 2 4 --format csv
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ALGORITHMS = ("dense", "allgather", "dsa", "gtopk", "oktopk", "oktopk/first")
COLUMNS = ("P", "algorithm", "ok", "median_ms", "sent_B", "recv_B", "meta_B", "nnz")


def worker(args: argparse.Namespace) -> None:
    import numpy as np

    import sparsecoll
    from sparsecoll import Communicator
    from sparsecoll.algorithms.base import reference_sum
    from sparsecoll.benchmarks.problems import make_problem
    from sparsecoll.registry import algorithm_class
    from sparsecoll.sparse import SparseVector, coalesce

    comm = Communicator()
    n = args.n
    k = round(args.density * n)
    vals, idx = make_problem(n, args.density, comm.rank, comm.size, args.overlap, np.float32)
    local = coalesce(idx, vals, n)
    inputs = [
        SparseVector(i, v, n) for i, v in comm.allgather_object((local.indices, local.values))
    ]
    reference = reference_sum(inputs)  # apart from every algorithm, dense included
    for name in args.algorithms:
        cls = algorithm_class(name.split("/")[0])  # (known: main checked)
        fresh = name.endswith("/first")
        algo = cls(**cls.default_options(n, k))
        times, sent, recv, meta = [], [], [], []
        out = None
        for it in range(args.warmup + args.iterations):
            if fresh:
                algo = cls(**cls.default_options(n, k))
            out = None  # (the last result freed before the clock starts)
            comm.barrier()
            t0 = comm.wtime()
            out = sparsecoll.allreduce(comm, vals, idx, n=n, algorithm=algo)
            dt = comm.wtime() - t0
            s = out.info["stats"]
            m = comm.allreduce_ints([s.bytes_sent, s.bytes_recv, s.meta_bytes_sent], "max")
            dt = comm.allreduce_floats([dt], "max")[0]
            if it >= args.warmup:
                times.append(dt)
                sent.append(int(m[0]))
                recv.append(int(m[1]))
                meta.append(int(m[2]))
        ok = cls(**cls.default_options(n, k)).verify(out, reference, inputs)
        ok = bool(comm.allreduce_ints([0 if ok else 1], "max")[0] == 0)
        if comm.rank == 0:
            row = dict(
                P=comm.size,
                algorithm=name,
                ok="yes" if ok else "NO",
                median_ms=round(float(np.median(times)) * 1e3, 2),
                sent_B=int(np.median(sent)),
                recv_B=int(np.median(recv)),
                meta_B=int(np.median(meta)),
                nnz=out.nnz,
            )
            print("ROW " + json.dumps(row), flush=True)


def main(argv: list[str] | None = None) -> int:
    from sparsecoll import available_algorithms
    from sparsecoll.benchmarks.cli import (
        SIZE_HELP,
        density_arg,
        int_arg,
        size_arg,
        unknown_algorithm,
    )
    from sparsecoll.benchmarks.problems import OVERLAPS

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter, epilog=SIZE_HELP
    )
    p.add_argument("--np", type=int_arg(1), nargs="+", default=[2, 4, 8, 16], help="rank counts")
    p.add_argument("-n", type=size_arg, default=4 * 2**20, help="dense length (default 4M)")
    p.add_argument("--density", type=density_arg, default=0.01, help="k per rank / n (default 1%%)")
    p.add_argument("--overlap", choices=OVERLAPS, default="random")
    p.add_argument("-i", "--iterations", type=int_arg(1), default=5)
    p.add_argument("-x", "--warmup", type=int_arg(0), default=1)
    p.add_argument(
        "--algorithms", nargs="+", default=list(ALGORITHMS), help="NAME or NAME/first (fresh)"
    )
    p.add_argument("--format", choices=("table", "csv", "json"), default="table")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    # an unknown name used to be skipped without a word (its rows missing from the table),
    # a repeated one run twice
    known = available_algorithms()
    for name in args.algorithms:
        if name.removesuffix("/first") not in known:
            p.error(unknown_algorithm(name.removesuffix("/first"), known))
    args.algorithms = list(dict.fromkeys(args.algorithms))
    if args.worker:
        worker(args)
        return 0
    root = Path(__file__).resolve().parent.parent
    from sparsecoll import __version__
    from sparsecoll._launch import mpiexec_command
    from sparsecoll.comm import mpi_library_version

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(root), env.get("PYTHONPATH")) if x)
    rows = []
    for nprocs in args.np:
        cmd = [*mpiexec_command(nprocs), sys.executable, __file__, "--worker"]
        cmd += ["-n", str(args.n), "--density", str(args.density), "--overlap", args.overlap]
        cmd += [
            "-i",
            str(args.iterations),
            "-x",
            str(args.warmup),
            "--algorithms",
            *args.algorithms,
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode:
            sys.stderr.write(proc.stdout + proc.stderr)
            return proc.returncode
        rows += [
            json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")
        ]
    if args.format == "json":
        print(json.dumps(rows, indent=1))
        return 0
    if args.format == "csv":
        print(",".join(COLUMNS))
        for r in rows:
            print(",".join(str(r[c]) for c in COLUMNS))
        return 0
    k = round(args.density * args.n)
    print(f"# sparsecoll {__version__} weak scaling: {mpi_library_version()}")
    print(
        f"# n={args.n} density={args.density} k/rank={k} overlap={args.overlap} float32 "
        f"iterations={args.iterations} warmup={args.warmup}; bytes: max over ranks, per call"
    )
    print(
        f"{'P':>3} {'algorithm':<14}{'ok':>4}{'median ms':>11}{'sent B/rank':>13}"
        f"{'recv B/rank':>13}{'sent/k pairs':>13}{'meta B':>9}{'nnz':>9}"
    )
    for r in rows:
        per_k = r["sent_B"] / (8 * k) if k else 0.0
        print(
            f"{r['P']:>3} {r['algorithm']:<14}{r['ok']:>4}{r['median_ms']:>11.2f}"
            f"{r['sent_B']:>13}{r['recv_B']:>13}{per_k:>13.2f}{r['meta_B']:>9}{r['nnz']:>9}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
