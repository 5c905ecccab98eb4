"""Blocking against nonblocking training steps: ``GradientReducer.step`` vs ``step_async``.

A DDP-like step: B buckets of n entries (one reducer each, density 1%, Gaussian gradients).
Per iteration, the time (max over ranks, median over iterations) of

* ``blocking``: the B ``step`` calls one after the other (MPI's blocking calls);
* ``async``: the B ``step_async`` calls submitted at once, then waited (the progress
  thread, its polling communicator);
* with ``--compute MS``, the same two with a GIL-free computation of about MS ms (float32
  matmuls, one BLAS thread) before each bucket, as backward produces buckets:
  ``blocking+compute`` and ``async+compute``.

``async`` against ``blocking`` shows what the progress thread's waiting costs (MPI advances
a nonblocking collective's rounds only inside its Test calls); the ``+compute`` pair, how
much of the communication the computation hides.

    mpiexec -n 4 python bench/async_step.py
    python bench/emulate_cluster.py -n 4 --rate 1gbit -- python bench/async_step.py --compute 6
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import time  # noqa: E402

import numpy as np  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    from sparsecoll.benchmarks.cli import (
        SIZE_HELP,
        RankZeroParser,
        algorithm_arg,
        check_memory,
        density_arg,
        float_arg,
        int_arg,
        local_ranks,
        size_arg,
    )

    # (checked before MPI starts: a usage error exits 2 on every rank, printed once)
    ap = RankZeroParser(description=__doc__.split("\n\n")[0], epilog=SIZE_HELP)
    ap.add_argument("--algorithm", type=algorithm_arg, default="exdyna")
    ap.add_argument("--buckets", type=int_arg(1), default=11)
    ap.add_argument("-n", type=size_arg, default=500_000, help="entries per bucket")
    ap.add_argument("--density", type=density_arg, default=0.01)
    ap.add_argument("--compute", type=float_arg(0), default=0.0, help="ms of compute per bucket")
    ap.add_argument("-i", "--iterations", type=int_arg(1), default=10)
    ap.add_argument("-x", "--warmup", type=int_arg(0), default=2)
    args = ap.parse_args(argv)
    what = f"the {args.buckets} buckets' float32 gradients"
    check_memory(ap, args.n, 4 * args.buckets, local_ranks(1), what)

    import sparsecoll
    from sparsecoll import Communicator
    from sparsecoll.training import GradientReducer

    comm = Communicator()
    modes = ["blocking", "async"] + (["blocking+compute", "async+compute"] if args.compute else [])
    reducers = {
        m: [
            GradientReducer(comm, args.n, args.algorithm, args.density) for _ in range(args.buckets)
        ]
        for m in modes
    }
    rng = np.random.default_rng([3, comm.rank])
    grads = [rng.standard_normal(args.n).astype(np.float32) for _ in range(args.buckets)]
    side = 64
    a = rng.standard_normal((side, side)).astype(np.float32)
    if args.compute:  # size one matmul to about the requested time
        while True:
            t = time.perf_counter()
            a @ a
            if time.perf_counter() - t >= args.compute / 1e3 or side >= 4096:
                break
            side = int(side * 1.25)
            a = rng.standard_normal((side, side)).astype(np.float32)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for it in range(args.warmup + args.iterations):
        for mode in modes:
            comm.barrier()
            t = time.perf_counter()
            if mode.startswith("blocking"):
                for red, g in zip(reducers[mode], grads):
                    if mode.endswith("compute"):
                        a @ a
                    red.step(g)
            else:
                reqs = []
                for red, g in zip(reducers[mode], grads):
                    if mode.endswith("compute"):
                        a @ a
                    reqs.append(red.step_async(g))
                for r in reqs:
                    r.wait()
            dt = float(comm.allreduce_floats([time.perf_counter() - t], op="max")[0])
            if it >= args.warmup:
                times[mode].append(dt)
    if comm.rank == 0:
        print(
            f"# sparsecoll {sparsecoll.__version__} async_step: P={comm.size} "
            f"{args.algorithm} buckets={args.buckets} n={args.n} density={args.density} "
            f"compute={args.compute} ms/bucket (matmul {side}x{side})"
        )
        print(f"{'mode':18s} {'median ms':>10s} {'min ms':>8s}")
        for m in modes:
            v = np.array(times[m]) * 1e3
            print(f"{m:18s} {np.median(v):10.1f} {v.min():8.1f}")


if __name__ == "__main__":
    main()
