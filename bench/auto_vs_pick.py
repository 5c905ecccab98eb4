"""auto against the algorithm it settles on: time per call, alternately, on the same inputs.

A sweep times each algorithm in its own block of calls, so on a noisy link two blocks of one
algorithm can differ by more than auto's own cost. This runs auto until it settles, then
alternates blocks of ``--calls`` calls of auto and of a separate instance of its pick (with
``--interleave``: each round's calls alternate one by one, so that both see the same
moments of the link), and prints each round's medians (the slowest rank's time per call)
and auto's median over the pick's. Run it under mpiexec (or ``bench/emulate_cluster.py``):

    mpiexec -n 3 python bench/auto_vs_pick.py -m 16M --density 0.001 --overlap random
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import sparsecoll
from sparsecoll.benchmarks.cli import densities_arg, int_arg, size_arg
from sparsecoll.benchmarks.problems import OVERLAPS, make_problem


def timed(comm, mpi, vals, idx, n, algos, calls: int) -> tuple[list[float], set]:
    """Each of ``algos``' median over ``calls`` calls (taken in turn) of the slowest rank's
    seconds per call, and the picks auto ran in them."""
    times: list[list[float]] = [[] for _ in algos]
    picks = set()
    for _ in range(calls):
        for algo, kept in zip(algos, times):
            out = None  # (the last result freed before the clock starts)
            mpi.Barrier()
            start = time.perf_counter()
            out = sparsecoll.allreduce(comm, vals, idx, n=n, algorithm=algo)
            kept.append(float(comm.allreduce_floats([time.perf_counter() - start], "max")[0]))
            picks.add(out.info.get("auto_choice"))
    return [statistics.median(t) for t in times], picks - {None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", type=size_arg, default=16 * 2**20, help="vector length (default 16M)")
    p.add_argument("--density", type=densities_arg, default=[0.001])
    p.add_argument("--overlap", choices=OVERLAPS, default="random")
    p.add_argument("--rounds", type=int_arg(1), default=5, help="blocks of each (default 5)")
    p.add_argument("--calls", type=int_arg(1), default=5, help="calls a block (default 5)")
    p.add_argument(
        "--interleave", action="store_true", help="alternate auto and its pick call by call"
    )
    args = p.parse_args(argv)
    from mpi4py import MPI

    comm = sparsecoll.Communicator(MPI.COMM_WORLD)
    n, density = args.m, args.density[0]
    vals, idx = make_problem(n, density, comm.rank, comm.size, args.overlap, "float32", seed=3)
    auto = sparsecoll.get_algorithm("auto")
    for _ in range(auto.settle_calls + 2):  # (measures its contenders, then settles)
        out = sparsecoll.allreduce(comm, vals, idx, n=n, algorithm=auto)
    pick = out.info["auto_choice"]
    base, _, wire = pick.partition(":")
    alone = sparsecoll.get_algorithm(base, **({"wire": wire} if wire else {}))
    timed(comm, MPI.COMM_WORLD, vals, idx, n, [alone], args.calls)  # (its first calls)
    ratios = []
    if comm.rank == 0:
        how = "one by one" if args.interleave else f"in blocks of {args.calls}"
        print(f"# P = {comm.size}, n = {n}, density {density}, {args.overlap}; "
              f"auto's pick: {pick}; calls alternating {how}")  # fmt: skip
        print(f"{'round':>6}{'auto ms':>10}{'pick ms':>10}{'ratio':>8}  auto ran")
    for r in range(args.rounds):
        if args.interleave:
            (a, b), ran = timed(comm, MPI.COMM_WORLD, vals, idx, n, [auto, alone], args.calls)
        else:
            (a,), ran = timed(comm, MPI.COMM_WORLD, vals, idx, n, [auto], args.calls)
            (b,), _ = timed(comm, MPI.COMM_WORLD, vals, idx, n, [alone], args.calls)
        ratios.append(a / b)
        if comm.rank == 0:
            print(
                f"{r + 1:>6}{a * 1e3:>10.3f}{b * 1e3:>10.3f}{a / b:>8.2f}  {','.join(sorted(ran))}"
            )
    if comm.rank == 0:
        print(f"# auto over its pick: median {statistics.median(ratios):.2f}, "
              f"range {min(ratios):.2f} to {max(ratios):.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
