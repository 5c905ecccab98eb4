"""oktopk's kept count K/k per call in an error-feedback stream: window rule vs the paper's.

GradientReducer(comm, n, "oktopk", density) with error feedback and exact local top-k, on
the streams of issue #11: Gaussian gradients with a linear scale profile along the vector
(``g = N(0, 1) · linspace(0.2, 2, n)``), ``stationary`` or ``decaying`` 10% per step. Rank 0
prints one row per (stream, rule): K/k over the calls after ``--skip``, the fraction in the
band [0.8, 1.25], and how many calls ran the exact select (scheduled every tau, or a window
rule's fallback).

  mpiexec -n 4 python bench/oktopk_density.py [--n 1000000 --density 0.01 --steps 40]
"""

from __future__ import annotations

import numpy as np

from sparsecoll import Communicator, GradientReducer

RULES = {
    "window": {"rule": "window"},
    "paper": {"rule": "paper", "adaptive": False},
    "paper-adaptive": {"rule": "paper", "adaptive": True},
}


def run(comm: Communicator, options: dict, decay: float, n: int, density: float, steps: int):
    red = GradientReducer(comm, n, "oktopk", density, **options)
    alg = red.algorithm
    exact, ratios = 0, []
    reduce = alg.reduce

    def recording(c, x):
        nonlocal exact
        out = reduce(c, x)
        exact += bool(out.info["recomputed"])
        ratios.append(out.nnz / red.k)
        return out

    alg.reduce = recording
    rng = np.random.default_rng([1, comm.rank])
    scale = np.linspace(0.2, 2.0, n)
    for t in range(steps):
        red.step((rng.standard_normal(n) * scale * decay**t).astype(np.float32))
    return np.asarray(ratios), exact


def main(argv: list[str] | None = None) -> int:
    from sparsecoll.benchmarks.cli import SIZE_HELP, RankZeroParser, density_arg, int_arg, size_arg

    # (checked before MPI starts: a usage error exits 2 on every rank, printed once)
    ap = RankZeroParser(description=__doc__.splitlines()[0], epilog=SIZE_HELP)
    ap.add_argument("--n", type=size_arg, default=1_000_000)
    ap.add_argument("--density", type=density_arg, default=0.01)
    ap.add_argument("--steps", type=int_arg(1), default=40)
    ap.add_argument("--skip", type=int_arg(0), default=5, help="calls left out of the statistics")
    args = ap.parse_args(argv)
    if args.skip >= args.steps:  # (rank 0 alone failed on the empty statistics, after the runs)
        ap.error(f"expecting --skip < --steps {args.steps}, got {args.skip}")
    comm = Communicator()
    if comm.rank == 0:
        print(
            f"# oktopk kept count: P={comm.size} n={args.n} density={args.density} "
            f"steps={args.steps}, error feedback, statistics over calls {args.skip + 1}.."
            f"{args.steps}"
        )
        print(
            f"{'stream':<12}{'rule':<16}{'mean K/k':>9}{'min':>8}{'max':>8}{'in band':>9}"
            f"{'exact calls':>12}"
        )
    for name, decay in (("stationary", 1.0), ("decaying", 0.9)):
        for rule, options in RULES.items():
            r, exact = run(comm, options, decay, args.n, args.density, args.steps)
            r = r[args.skip :]
            if comm.rank == 0:
                band = np.mean((r >= 0.8) & (r <= 1.25))
                print(
                    f"{name:<12}{rule:<16}{r.mean():>9.3f}{r.min():>8.3f}{r.max():>8.3f}"
                    f"{band:>8.1%}{exact:>12}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
