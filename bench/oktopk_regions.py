"""oktopk's bytes per rank when the large gradients move to another part of the vector.

GradientReducer(comm, n, "oktopk", density) with error feedback and exact local top-k, on
Gaussian gradients in which one "layer" (2% of n, more than k entries) is ``--scale`` times
larger, and the layer moves to another place every ``--every`` steps (which layer's
gradients dominate changes during training). oktopk repartitions its regions every
``tau_prime`` calls (64 by default, the paper's schedule) and on the call after one in which
a region received more than ``imbalance·k(P−1)/P`` pairs (default 2). With ``--imbalance
none`` (the paper's schedule only) every rank's selection falls, after a move, in the one or
two regions now holding the layer until the next scheduled repartition. Rank 0 prints, per
call: whether it repartitioned, the largest bytes sent and received by any rank, and their
ratio to the pair bound 6k(P−1)/P (int32 indices and float32 values, 8 bytes a pair).

  mpiexec -n 8 python bench/oktopk_regions.py [--n 200000 --density 0.01 --steps 40]
                                               [--tau-prime 64 --imbalance 2|none]
"""

from __future__ import annotations

import numpy as np

from sparsecoll import Communicator, GradientReducer
from sparsecoll.benchmarks.cli import RankZeroParser


def main(argv: list[str] | None = None) -> int:
    from sparsecoll.benchmarks.cli import SIZE_HELP, density_arg, float_arg, int_arg, size_arg

    # (checked before MPI starts: a usage error exits 2 on every rank, printed once)
    ap = RankZeroParser(description=__doc__.splitlines()[0], epilog=SIZE_HELP)
    ap.add_argument("--n", type=size_arg, default=200_000)
    ap.add_argument("--density", type=density_arg, default=0.01)
    ap.add_argument("--steps", type=int_arg(1), default=40)
    ap.add_argument("--every", type=int_arg(1), default=10, help="steps between the layer's moves")
    ap.add_argument("--scale", type=float_arg(0, above=True), default=1000.0)
    ap.add_argument("--tau-prime", type=int_arg(1), default=64)
    ap.add_argument(
        "--imbalance",
        type=lambda s: None if s == "none" else float_arg(0, above=True)(s),
        default=2.0,
        help="oktopk's early-repartition trigger, or none",
    )
    args = ap.parse_args(argv)
    comm = Communicator()
    n, p = args.n, comm.size
    red = GradientReducer(
        comm, n, "oktopk", args.density, tau_prime=args.tau_prime, imbalance=args.imbalance
    )
    alg, k = red.algorithm, red.k
    infos = []
    reduce = alg.reduce

    def recording(c, x):
        out = reduce(c, x)
        infos.append(out.info)
        return out

    alg.reduce = recording
    rng = np.random.default_rng([3, comm.rank])
    width = n // 50
    bound = 6 * k * (p - 1) / p * 8
    if comm.rank == 0:
        print(
            f"# oktopk regions after a move: P={p} n={n} k={k} layer={width} entries x"
            f"{args.scale:g}, moved every {args.every} steps, tau_prime={args.tau_prime}, "
            f"imbalance={args.imbalance}; "
            f"bound 6k(P-1)/P pairs = {bound:.0f} bytes"
        )
        print(
            f"{'call':>4} {'layer at':>8} {'repart':>6} {'max sent':>9} {'max recv':>9} "
            f"{'/bound':>6}"
        )
    for t in range(args.steps):
        at = (t // args.every) * (n // 7) % (n - width)
        g = rng.standard_normal(n)
        g[at : at + width] *= args.scale
        red.step(g.astype(np.float32))
        st = red.stats()
        sent, recv = comm.allgather_ints([st["bytes_sent"], st["bytes_recv"]]).max(axis=0)
        if comm.rank == 0:
            worst = max(int(sent), int(recv))
            print(
                f"{t:4d} {at:8d} {bool(infos[-1]['repartitioned'])!s:>6} "
                f"{int(sent):9d} {int(recv):9d} "
                + (f"{worst / bound:6.2f}" if bound else f"{'-':>6}")  # (P = 1: no bound)
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
