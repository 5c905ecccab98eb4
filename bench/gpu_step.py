"""``GradientReducer.step`` on device (CuPy) gradients, next to one device-to-device copy.

    python bench/gpu_step.py -m 100M                 # P = 1
    mpiexec -n 4 python bench/gpu_step.py -m 25M     # P = 4 sharing a GPU (host staging)

Per algorithm: the median step time (slowest rank, the device synchronized before and after
each step) and its ratio to one ``cupy.copyto`` of the gradient (read n, write n), timed
before every step.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

ALGORITHMS = ("dense", "allgather", "gtopk", "oktopk", "exdyna")


def main(argv: list[str] | None = None) -> None:
    from sparsecoll.benchmarks.cli import (
        SIZE_HELP,
        add_timing_arguments,
        density_arg,
        parse_algorithms,
        size_arg,
    )
    from sparsecoll.registry import available_algorithms

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=SIZE_HELP)
    ap.add_argument("-m", "--size", type=size_arg, default="100M")
    ap.add_argument("--density", type=density_arg, default=0.01)
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    add_timing_arguments(ap, 10, 5, timed="timed steps", untimed="untimed steps first")
    args = ap.parse_args(argv)
    try:  # (an unknown name failed once the ones before it had run)
        known = available_algorithms()
        args.algorithms = parse_algorithms([args.algorithms], known, "--algorithms")
    except ValueError as exc:
        ap.error(str(exc))
    import cupy as cp  # after the arguments: --help works without CuPy

    from sparsecoll import Communicator, GradientReducer

    n = args.size
    comm = Communicator()
    cp.cuda.Device(comm.rank % cp.cuda.runtime.getDeviceCount()).use()
    rng = cp.random.default_rng(comm.rank)
    scale = cp.linspace(0.2, 2.0, n, dtype=cp.float32)
    grads = [rng.standard_normal(n, dtype=cp.float32) * scale for _ in range(2)]
    g = cp.empty(n, cp.float32)
    copy_dst = cp.empty(n, cp.float32)
    sync = cp.cuda.Device().synchronize
    rows = []
    for name in args.algorithms:
        red = GradientReducer(comm, n, name, args.density)
        steps, copies = [], []
        for it in range(args.warmup + args.iterations):
            cp.copyto(g, grads[it % 2])
            sync()
            t = time.perf_counter()
            cp.copyto(copy_dst, g)
            sync()
            copy_s = time.perf_counter() - t
            comm.barrier()
            t = time.perf_counter()
            red.step(g, out=g)
            sync()
            step_s = comm.allreduce_floats([time.perf_counter() - t], "max")[0]
            if it >= args.warmup:
                steps.append(step_s)
                copies.append(copy_s)
        st = red.stats()
        rows.append(
            (name, np.median(steps) * 1e3, np.median(copies) * 1e3, st["bytes_sent"],
             st["achieved_density"] / args.density)
        )  # fmt: skip
    if comm.rank == 0:
        dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
        print(f"# GradientReducer.step on device gradients, {dev}, P = {comm.size}, n = {n:,}")
        print(f"{'algorithm':<10}{'step ms':>9}{'copy ms':>9}{'x copy':>8}{'bytes/rank':>13}"
              f"{'nnz/k':>7}")  # fmt: skip
        for name, s, c, b, d in rows:
            dens = "-" if name == "dense" else f"{d:.2f}"
            print(f"{name:<10}{s:>9.2f}{c:>9.3f}{s / c:>8.1f}{b:>13,}{dens:>7}")


if __name__ == "__main__":
    main()
