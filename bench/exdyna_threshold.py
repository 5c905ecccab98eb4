"""exdyna's achieved density K/k per call, our threshold window vs the authors' rule.

Two synthetic streams, the same on every launcher: ``stationary`` (fresh Gaussian gradients,
no error feedback: the authors' setting for their rule) and ``feedback`` (the same gradients
with error feedback, as in training). Rank 0 prints one row per (stream, rule).

  mpiexec -n 4 python bench/exdyna_threshold.py [--n 100000 --density 0.01 --steps 600]
"""

from __future__ import annotations

import numpy as np

from sparsecoll import Communicator
from sparsecoll.algorithms.exdyna import ExDyna


def run(comm: Communicator, rule: str, feedback: bool, n: int, k: int, steps: int) -> np.ndarray:
    alg = ExDyna(k=k, rule=rule)
    rng = np.random.default_rng([2, comm.rank])
    residual = np.zeros(n, np.float32)
    ratios = []
    for _ in range(steps):
        acc = rng.standard_normal(n).astype(np.float32)
        if feedback:
            acc += residual
        out = alg.reduce_dense(comm, acc)
        if feedback:
            acc[out.indices] = 0
            residual = acc
        ratios.append(out.nnz / k)
    return np.asarray(ratios)


def main(argv: list[str] | None = None) -> int:
    from sparsecoll.benchmarks.cli import SIZE_HELP, RankZeroParser, density_arg, int_arg, size_arg

    # (checked before MPI starts: a usage error exits 2 on every rank, printed once)
    ap = RankZeroParser(description=__doc__.splitlines()[0], epilog=SIZE_HELP)
    ap.add_argument("--n", type=size_arg, default=100_000)
    ap.add_argument("--density", type=density_arg, default=0.01)
    ap.add_argument("--steps", type=int_arg(1), default=600)
    ap.add_argument("--skip", type=int_arg(0), default=100, help="calls left out of the statistics")
    args = ap.parse_args(argv)
    if args.skip >= args.steps:  # (rank 0 alone failed on the empty statistics, after the runs)
        ap.error(f"expecting --skip < --steps {args.steps}, got {args.skip}")
    comm = Communicator()
    k = round(args.density * args.n)
    if comm.rank == 0:
        print(
            f"# exdyna threshold rules: P={comm.size} n={args.n} k={k} steps={args.steps}, "
            f"statistics over calls {args.skip + 1}..{args.steps}"
        )
        print(f"{'stream':<12}{'rule':<9}{'mean K/k':>9}{'min':>8}{'max':>8}{'within 5%':>11}")
    for feedback in (False, True):
        for rule in ("window", "authors"):
            r = run(comm, rule, feedback, args.n, k, args.steps)[args.skip :]
            if comm.rank == 0:
                within = np.mean(np.abs(r - 1) <= 0.05)
                name = "feedback" if feedback else "stationary"
                print(
                    f"{name:<12}{rule:<9}{r.mean():>9.4f}{r.min():>8.3f}{r.max():>8.3f}"
                    f"{within:>10.1%}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
