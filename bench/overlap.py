"""Overlap of a nonblocking sparse allreduce with a GIL-releasing computation.

Every rank holds k = density·n random nonzeros. The script times, as the median over
iterations of the max over ranks:

* ``comm``: ``sparsecoll.iallreduce(...).wait()`` alone;
* ``compute``: a computation that releases the GIL (float32 matmuls, one BLAS thread),
  sized to take about as long as ``comm``;
* ``both``: the iallreduce started, then the computation, then ``wait()``;

and prints ``ratio = both / (comm + compute)`` (1.0: no overlap; 0.5: perfect overlap of
equal parts). It also reports CPU time per second of wall time: of the progress thread
during ``comm`` (its local work included; max over ranks), and, while the other ranks
start the call ``--late`` seconds after rank 0 (so rank 0 only waits), of rank 0's progress
thread and, for comparison, of rank 0 in a blocking ``sparsecoll.allreduce`` (MPI's
blocking calls busy-poll a core; the progress thread tests and sleeps instead).

    mpiexec -n 2 python bench/overlap.py
    python bench/emulate_cluster.py -n 2 --rate 1gbit -- python bench/overlap.py
"""

from __future__ import annotations

import os

# one BLAS thread: the computation stands for one rank's share of the cores
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import time  # noqa: E402

import numpy as np  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    from sparsecoll.benchmarks.cli import (
        SIZE_HELP,
        RankZeroParser,
        algorithm_arg,
        density_arg,
        float_arg,
        int_arg,
        size_arg,
    )

    # (checked before MPI starts: a usage error exits 2 on every rank, printed once; --late
    # -1 or nan used to raise in time.sleep on the late ranks alone, rank 0 left waiting)
    parser = RankZeroParser(description=__doc__.splitlines()[0], epilog=SIZE_HELP)
    parser.add_argument("-n", type=size_arg, default="16M", help="dense length (16M)")
    parser.add_argument("--density", type=density_arg, default=0.01)
    parser.add_argument("--algorithm", type=algorithm_arg, default="allgather")
    parser.add_argument("--iterations", type=int_arg(1), default=10)
    parser.add_argument("--warmup", type=int_arg(0), default=3)
    parser.add_argument("--matrix", type=int_arg(1), default=256, help="side of the matmuls")
    parser.add_argument(
        "--late", type=float_arg(0), default=0.5, help="seconds the others are late"
    )
    args = parser.parse_args(argv)

    import sparsecoll
    from sparsecoll import Communicator
    from sparsecoll.registry import algorithm_class

    comm = Communicator()
    n, k = args.n, round(args.density * args.n)
    rng = np.random.default_rng([7, comm.rank])
    idx = rng.choice(n, size=k, replace=False).astype(np.int64)
    vals = rng.standard_normal(k).astype(np.float32)
    opts = algorithm_class(args.algorithm).default_options(n, k)
    a = rng.standard_normal((args.matrix, args.matrix)).astype(np.float32)
    engine = comm.engine()

    def comm_once() -> None:
        sparsecoll.iallreduce(comm, vals, idx, n=n, algorithm=args.algorithm, **opts).wait()

    def compute(reps: int) -> None:
        b = a
        for _ in range(reps):
            b = np.tanh(a @ b)  # numpy releases the GIL in both

    def timed(fn, *fargs, **fkw) -> float:
        comm.barrier()
        t0 = time.perf_counter()
        fn(*fargs, **fkw)
        return float(comm.allreduce_floats([time.perf_counter() - t0], "max")[0])

    for _ in range(args.warmup):
        comm_once()
        sparsecoll.allreduce(comm, vals, idx, n=n, algorithm=args.algorithm, **opts)
    # size the computation to the communication's time (the same reps on every rank)
    t_comm0 = float(np.median([timed(comm_once) for _ in range(3)]))
    t_unit = float(np.median([timed(compute, 20) for _ in range(3)])) / 20
    reps = int(comm.allreduce_ints([max(1, round(t_comm0 / t_unit))], "max")[0])

    def both() -> None:
        req = sparsecoll.iallreduce(comm, vals, idx, n=n, algorithm=args.algorithm, **opts)
        compute(reps)
        req.wait()

    t_comm, t_compute, t_both, t_block, cpu_wait, cpu_block = [], [], [], [], [], []
    for _ in range(args.iterations):
        cpu0 = engine.cpu_time()
        t_comm.append(timed(comm_once))
        cpu_wait.append((engine.cpu_time() - cpu0) / t_comm[-1])
        t_compute.append(timed(compute, reps))
        t_both.append(timed(both))
        cpu0 = time.thread_time()
        t_block.append(
            timed(sparsecoll.allreduce, comm, vals, idx, n=n, algorithm=args.algorithm, **opts)
        )
        cpu_block.append((time.thread_time() - cpu0) / t_block[-1])
    # rank 0 waits alone for --late seconds: what does waiting cost it?
    comm.barrier()
    if comm.rank:
        time.sleep(args.late)
    eng0, t0 = engine.cpu_time(), time.perf_counter()
    sparsecoll.iallreduce(comm, vals, idx, n=n, algorithm=args.algorithm, **opts).wait()
    late_async = (engine.cpu_time() - eng0) / (time.perf_counter() - t0)
    comm.barrier()
    if comm.rank:
        time.sleep(args.late)
    cpu0, t0 = time.thread_time(), time.perf_counter()
    sparsecoll.allreduce(comm, vals, idx, n=n, algorithm=args.algorithm, **opts)
    late_block = (time.thread_time() - cpu0) / (time.perf_counter() - t0)

    med = {
        name: float(np.median(v))
        for name, v in dict(comm=t_comm, compute=t_compute, both=t_both, blocking=t_block).items()
    }
    # CPU shares vary per rank: report the largest
    cpu = comm.allreduce_floats([np.median(cpu_wait), np.median(cpu_block)], "max")
    if comm.rank == 0:
        ratio = med["both"] / (med["comm"] + med["compute"])
        print(f"# sparsecoll {sparsecoll.__version__} overlap: iallreduce + GIL-free compute")
        print(f"# P={comm.size} n={n} density={args.density} algorithm={args.algorithm}")
        print(f"# matmuls {args.matrix}x{args.matrix} x{reps}; medians of {args.iterations}")
        print(f"{'what':<34}{'ms':>10}")
        for name, label in (
            ("comm", "iallreduce alone (wait)"),
            ("compute", "computation alone"),
            ("both", "both overlapped"),
            ("blocking", "blocking allreduce"),
        ):
            print(f"{label:<34}{1e3 * med[name]:>10.2f}")
        print(f"{'ratio both/(comm+compute)':<34}{ratio:>10.3f}")
        print(f"{'CPU s/s, progress thread, comm':<34}{cpu[0]:>10.3f}")
        print(f"{'CPU s/s, blocking allreduce':<34}{cpu[1]:>10.3f}")
        print(f"{f'CPU s/s, progress thread, late {args.late:g}s':<34}{late_async:>10.3f}")
        print(f"{f'CPU s/s, blocking, late {args.late:g}s':<34}{late_block:>10.3f}")


if __name__ == "__main__":
    main()
