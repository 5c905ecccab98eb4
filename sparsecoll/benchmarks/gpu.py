"""GPU benchmarks: selection against torch.topk, and allreduce of device buffers.

  python -m sparsecoll.benchmarks.gpu select [-m 1M,25M,100M] [--density 0.001,0.01]
  mpiexec -n P python -m sparsecoll.benchmarks.gpu allreduce [-m 25M] [--density 0.01]
      [--comm mpi|nccl] [--algorithm NAME ...]

``select`` times, on one GPU, sparsecoll's exact top-k (radix select), threshold selection
at the exact k-th value, the k-th value alone, and ``torch.topk`` of ``|x|`` (when PyTorch
sees the GPU) on float vectors of length n. ``allreduce`` times every algorithm on device
inputs (``make_problem`` patterns) through the chosen communicator: ``mpi`` stages device
buffers through pinned host memory unless MPI is CUDA-aware, ``nccl`` moves collective
payloads over NCCL (one GPU per rank). Times: median (and min) over iterations after
warm-up, each the max over ranks, wall clock around a device synchronize. Rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import __version__
from .._array import cupy_or_none
from ..comm import Communicator, mpi_library_version
from .cli import DTYPES, SIZE_HELP, add_timing_arguments, densities_arg, size_arg, sizes_arg
from .problems import OVERLAP_HELP, OVERLAPS, make_problem

__all__ = ["main"]


def _device_name(cp: Any) -> str:
    try:
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        name = props["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        return "unknown device"


def _time(fn: Callable[[], Any], sync: Callable[[], None], iters: int, warmup: int) -> list[float]:
    out = []
    for it in range(warmup + iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if it >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def _torch_or_none() -> Any:
    try:
        import torch
    except Exception:
        return None
    return torch if torch.cuda.is_available() else None


def bench_select(args: argparse.Namespace, cp: Any) -> list[dict[str, Any]]:
    from ..select import _cupy as sel

    torch = None if args.no_torch else _torch_or_none()
    dtype = np.dtype(args.dtype)
    rows = []

    def sync() -> None:
        cp.cuda.Device().synchronize()

    for n in args.n:
        rng = np.random.default_rng(0)
        x = cp.asarray(rng.standard_normal(n).astype(dtype))
        for density in args.density:
            k = max(1, round(density * n))
            t = sel.kth_largest_abs(x, k)
            got = sel.count_ge(x, t)
            methods: dict[str, Callable[[], Any]] = {
                "sparsecoll topk": lambda x=x, k=k: sel.topk(x, k),
                "sparsecoll threshold": lambda x=x, t=t: sel.threshold(x, t),
                "sparsecoll kth value": lambda x=x, k=k: sel.kth_largest_abs(x, k),
            }
            if torch is not None:
                tx = torch.from_dlpack(x)
                methods["torch.topk |x|"] = lambda tx=tx, k=k: torch.topk(tx.abs(), k, sorted=False)
            for name, fn in methods.items():
                ts = _time(fn, sync, args.iterations, args.warmup)
                rows.append(
                    {
                        "n": n,
                        "density": density,
                        "k": k,
                        "selected": got if name == "sparsecoll threshold" else k,
                        "method": name,
                        "median_ms": 1e3 * statistics.median(ts),
                        "min_ms": 1e3 * min(ts),
                        "GB/s": n * dtype.itemsize / statistics.median(ts) / 1e9,
                    }
                )
            del methods
        del x
    return rows


def bench_allreduce(args: argparse.Namespace, cp: Any) -> tuple[Communicator, list[dict[str, Any]]]:
    from ..api import allreduce
    from ..registry import algorithm_class, available_algorithms

    comm: Communicator
    if args.comm == "nccl":
        from ..nccl import NCCLCommunicator

        comm = NCCLCommunicator()
    else:
        comm = Communicator()
    names = args.algorithm or available_algorithms()
    rows = []

    def sync() -> None:
        cp.cuda.Device().synchronize()

    for n in args.n:
        for density in args.density:
            vals, idx = make_problem(n, density, comm.rank, comm.size, args.overlap, args.dtype)
            dv, di = cp.asarray(vals), cp.asarray(idx)
            k = max(1, round(density * n))
            for name in names:
                cls = algorithm_class(name)
                if cls.densifies and n > args.max_dense:
                    continue
                ts, sent = [], 0
                for it in range(args.warmup + args.iterations):
                    algo = cls(**cls.default_options(n, k))
                    out = None  # (the last result freed before the clock starts)
                    sync()
                    comm.barrier()
                    t0 = comm.wtime()
                    out = allreduce(comm, dv, di, n=n, algorithm=algo)
                    sync()
                    dt = comm.wtime() - t0
                    sent = out.info["stats"].bytes_sent
                    if it >= args.warmup:
                        ts.append(comm.allreduce_floats([dt], "max")[0])
                rows.append(
                    {
                        "n": n,
                        "density": density,
                        "algorithm": name,
                        "median_ms": 1e3 * statistics.median(ts),
                        "min_ms": 1e3 * min(ts),
                        "bytes/rank": int(comm.allreduce_ints([sent], "max")[0]),
                        "result_nnz": out.nnz,
                    }
                )
    return comm, rows


def _print(rows: list[dict[str, Any]], fmt: str, header: list[str]) -> None:
    if fmt == "json":
        print(json.dumps({"header": header, "rows": rows}, indent=1))
        return
    if not rows:
        return
    cols = list(rows[0])
    if fmt == "csv":
        print(",".join(cols))
        for r in rows:
            print(",".join(str(r[c]) for c in cols))
        return
    for line in header:
        print(f"# {line}")
    widths = {c: max(len(c), *(len(_cell(r[c])) for r in rows)) + 2 for c in cols}
    print("".join(c.rjust(widths[c]) for c in cols))
    for r in rows:
        print("".join(_cell(r[c]).rjust(widths[c]) for c in cols))


def _cell(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m sparsecoll.benchmarks.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=SIZE_HELP,
    )
    p.add_argument("suite", choices=("select", "allreduce"))
    p.add_argument(
        "-m",
        "--message-size",
        dest="n",
        type=sizes_arg,
        default=None,
        metavar="SIZES",
        help="lengths n in elements, e.g. 1M,25M,100M or 1M:64M",
    )
    # the old spelling, kept working (mpiexec's -n is the rank count: prefer -m)
    p.add_argument("-n", dest="n", type=sizes_arg, help=argparse.SUPPRESS)
    p.add_argument("--density", type=densities_arg, default=[0.001, 0.01])
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    add_timing_arguments(p, 20, 3, untimed="untimed calls first")
    p.add_argument("--format", choices=("table", "csv", "json"), default="table")
    p.add_argument("--no-torch", action="store_true", help="skip the torch.topk comparison")
    p.add_argument("--comm", choices=("mpi", "nccl"), default="mpi")
    p.add_argument("--overlap", choices=OVERLAPS, default="random", help=OVERLAP_HELP)
    p.add_argument("--algorithm", action="append", help="allreduce: only these (repeatable)")
    p.add_argument(
        "--max-dense", type=size_arg, default=2**28, help="skip densifying algorithms above"
    )
    args = p.parse_args(argv)
    cp = cupy_or_none()
    if cp is None:
        print("sparsecoll.benchmarks.gpu: no CuPy with a CUDA device", file=sys.stderr)
        return 2
    if args.suite == "select":
        args.n = args.n or [2**20, 25 * 2**20, 100 * 2**20]
        rows = bench_select(args, cp)
        header = [
            f"sparsecoll {__version__} GPU selection on {_device_name(cp)}",
            f"dtype={args.dtype} iterations={args.iterations} warmup={args.warmup}",
        ]
        _print(rows, args.format, header)
        return 0
    args.n = args.n or [25 * 2**20]
    comm, rows = bench_allreduce(args, cp)
    if comm.rank == 0:
        header = [
            f"sparsecoll {__version__} allreduce of device buffers on {_device_name(cp)}",
            f"{mpi_library_version()}; comm={args.comm} cuda_aware={comm.cuda_aware}",
            f"P={comm.size} dtype={args.dtype} overlap={args.overlap} "
            f"iterations={args.iterations} warmup={args.warmup}",
        ]
        _print(rows, args.format, header)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
