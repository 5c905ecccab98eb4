"""exdyna's rebalancing on a skewed gradient: per-partition counts and sizes over the calls.

Magnitudes 1.5x larger in the first half of [0, n) (the skew of
tests/mpi/test_exdyna.py::test_rebalancing_follows_a_skewed_gradient), k = 50 * max(P, 8),
n = 100 * k, 4 * P blocks. Every ``--every`` calls rank 0 prints the largest count over
the mean count and the partitions' sizes in blocks; at the end, the median and the largest
of that ratio over the second half of the calls (one call's ratio is noisy: fresh data each
call).

    mpiexec -n 16 python bench/exdyna_rebalance.py --calls 120
"""

from __future__ import annotations

import numpy as np


def main(argv: list[str] | None = None) -> None:
    from sparsecoll.benchmarks.cli import RankZeroParser, int_arg

    # (checked before MPI starts: --every 0 failed on rank 0 alone, --calls 0 at the end)
    ap = RankZeroParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int_arg(1), default=120)
    ap.add_argument("--every", type=int_arg(1), default=20)
    args = ap.parse_args(argv)

    from mpi4py import MPI

    from sparsecoll import Communicator
    from sparsecoll.algorithms.exdyna import ExDyna

    comm = Communicator(MPI.COMM_WORLD)
    p = comm.size
    k = 50 * max(p, 8)
    n = 100 * k
    alg = ExDyna(k=k, blocks=4 * p)
    rng = np.random.default_rng([3, comm.rank])
    weight = np.where(np.arange(n) < n // 2, 1.5, 1.0)
    if comm.rank == 0:
        print(f"P={p} n={n} k={k} blocks={4 * p}")
        print("call  max/mean count  sizes (blocks)")
    ratios = []
    for t in range(args.calls):
        x = rng.standard_normal(n).astype(np.float32) * weight
        out = alg.reduce_dense(comm, x)
        c = np.asarray(out.info["counts"], dtype=np.float64)
        ratios.append(c.max() / c.mean())
        if comm.rank == 0 and (t == 0 or (t + 1) % args.every == 0):
            print(f"{t + 1:4d}  {ratios[-1]:14.2f}  {np.diff(alg.bounds).tolist()}")
    if comm.rank == 0:
        late = ratios[args.calls // 2 :]
        print(
            f"calls {args.calls // 2 + 1}-{args.calls}: max/mean count median "
            f"{np.median(late):.2f}, largest {max(late):.2f}"
        )


if __name__ == "__main__":
    main()
