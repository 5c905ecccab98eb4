"""GradientReducer.step on a JAX gradient: inside ``jax.jit`` against outside it.

    mpiexec -n 3 python bench/jax_step.py --n 1000000 --steps 30

Two reducers of the same options step on the same gradients, alternately (each first every
other step): one called on a ``jax.Array`` outside jit (``reducer.step(g)``), one inside a
jitted function (``sparsecoll.integrations.jax.step``), each timed to its result being ready,
after a barrier. Both give the same bits at every step (checked). The slowest rank's time of
each step counts; rank 0 prints the median, min and max and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import sparsecoll
from sparsecoll.integrations import jax as sc_jax


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--algorithm", default="oktopk")
    p.add_argument("--density", type=float, default=0.01)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()

    def reducer() -> sparsecoll.GradientReducer:
        return sparsecoll.GradientReducer(
            comm, n=args.n, algorithm=args.algorithm, density=args.density
        )

    eager, traced = reducer(), reducer()
    jitted = jax.jit(lambda g: sc_jax.step(traced, g))
    keys = jax.random.split(jax.random.fold_in(jax.random.key(0), rank), 4)
    grads = [jax.random.normal(k, (args.n,), jnp.float32) for k in keys]
    times: dict[str, list[float]] = {"outside jit": [], "inside jit": []}
    for i in range(args.warmup + args.steps):
        g = grads[i % len(grads)]
        outs = {}
        paths = [("outside jit", eager.step), ("inside jit", jitted)]
        for name, fn in paths[:: 1 if i % 2 else -1]:  # (each goes first every other step)
            comm.Barrier()
            t0 = time.perf_counter()
            outs[name] = fn(g).block_until_ready()
            dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if i >= args.warmup:
                times[name].append(dt)
        # (the same state and gradients: the same bits)
        assert np.asarray(outs["outside jit"]).tobytes() == np.asarray(outs["inside jit"]).tobytes()
    if rank == 0:
        print(f"# sparsecoll {sparsecoll.__version__}, jax {jax.__version__}")
        print(f"# GradientReducer.step, {args.algorithm}, density {args.density}, n {args.n}")
        print(f"# P {comm.Get_size()}, {args.steps} steps after {args.warmup} warm-up")
        print(f"{'path':<12} {'Median(ms)':>11} {'Min(ms)':>9} {'Max(ms)':>9}")
        for name, ts in times.items():
            ms = [t * 1e3 for t in ts]
            print(f"{name:<12} {statistics.median(ms):>11.2f} {min(ms):>9.2f} {max(ms):>9.2f}")
        ratio = statistics.median(times["inside jit"]) / statistics.median(times["outside jit"])
        print(f"# inside/outside (medians): {ratio:.3f}")


if __name__ == "__main__":
    main()
