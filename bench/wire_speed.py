"""Wire encoding benchmark: sparsecoll.wire's encode and decode speed and size, one core.

For each density and dtype: sorted unique uniform indices over [0, n) (int32), values
standard normal ("normal") or the entries of a standard normal vector above the density's
magnitude quantile ("topk", what top-k selection sends). Columns: bytes per pair sent
(header included), encode and decode time per pair, and their throughput in GB/s of raw
pair bytes (index + value bytes) per core. Times are the median (and min) of --repeat runs
after one untimed run (Numba's compile or cache load stays out), in this process's CPU time
(``--clock cpu``, the default: what a core of its own would take, on a shared machine too)
or wall time (``--clock wall``). One thread: the kernels are serial.

With ``--collective`` (under mpiexec) it measures instead the payload bytes each rank sends
in each algorithm that takes ``wire`` (allgather, dsa, hashed, recursive_doubling, ring)
with ``wire="raw"`` and ``"compact"`` (CommStats, "random" overlap), and the bytes per pair
that makes: raw pair bytes times the compact/raw ratio (not for hashed, whose raw mode already
sends its way back as values under a bitmap).

    PYTHONPATH=$PWD python bench/wire_speed.py                 # n = 16M, 4 densities
    PYTHONPATH=$PWD python bench/wire_speed.py -n 2M --densities 0.01 --format csv
    PYTHONPATH=$PWD mpiexec -n 3 python bench/wire_speed.py --collective --densities 0.01
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import sparsecoll
from sparsecoll.benchmarks.cli import densities_arg, int_arg, size_arg
from sparsecoll.wire import decode_pairs, encode_pairs

COLUMNS = (
    "density", "dtype", "values", "pairs", "bytes/pair", "enc ns/pair", "dec ns/pair",
    "enc GB/s", "dec GB/s", "enc min ns", "dec min ns",
)  # fmt: skip


def problem(n: int, density: float, dtype: str, values: str, seed: int):
    rng = np.random.default_rng(seed)
    if values == "topk":
        x = rng.standard_normal(n).astype(dtype)
        k = max(1, int(n * density))
        cut = np.partition(np.abs(x), n - k)[n - k]
        idx = np.flatnonzero(np.abs(x) >= cut).astype(np.int32)
        return idx, x[idx]
    idx = np.sort(rng.choice(n, max(1, int(n * density)), replace=False)).astype(np.int32)
    return idx, rng.standard_normal(idx.shape[0]).astype(dtype)


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def timed(fn, repeat: int, clock) -> tuple[float, float]:
    fn()
    times = []
    for _ in range(repeat):
        t = clock()
        fn()
        times.append(clock() - t)
    return float(np.median(times)), min(times)


def row(n: int, density: float, dtype: str, values: str, repeat: int, clock) -> dict:
    idx, vals = problem(n, density, dtype, values, seed=1)
    m = idx.shape[0]
    buf = encode_pairs(idx, vals, 0, n)
    got_i, got_v = decode_pairs(buf, idx.dtype, vals.dtype, 0, n)
    assert np.array_equal(got_i, idx) and got_v.tobytes() == vals.tobytes()
    enc, enc_min = timed(lambda: encode_pairs(idx, vals, 0, n), repeat, clock)
    dec, dec_min = timed(lambda: decode_pairs(buf, idx.dtype, vals.dtype, 0, n), repeat, clock)
    raw = idx.nbytes + vals.nbytes
    return {
        "density": density,
        "dtype": dtype,
        "values": values,
        "pairs": m,
        "bytes/pair": round(buf.shape[0] / m, 3),
        "enc ns/pair": round(enc / m * 1e9, 2),
        "dec ns/pair": round(dec / m * 1e9, 2),
        "enc GB/s": round(raw / enc / 1e9, 2),
        "dec GB/s": round(raw / dec / 1e9, 2),
        "enc min ns": round(enc_min / m * 1e9, 2),
        "dec min ns": round(dec_min / m * 1e9, 2),
    }


WIRED = ("allgather", "dsa", "hashed", "recursive_doubling", "ring")


def collective(n: int, densities: list[float], dtypes: list[str], names=WIRED) -> int:
    """Bytes each rank sends with wire="raw" and "compact" (run under mpiexec)."""
    from mpi4py import MPI

    from sparsecoll.benchmarks.problems import make_problem

    comm = sparsecoll.Communicator(MPI.COMM_WORLD)
    if comm.rank == 0:
        print(f"# bytes sent per rank, sparsecoll {sparsecoll.__version__}, P = {comm.size}")
        print(f"# n = {n}, 'random' overlap; pair: raw pair bytes x compact/raw")
        print("# (hashed's raw mode returns values under a bitmap already: no B/pair)")
        heads = ("dtype", "density", "raw B", "compact B", "ratio", "B/pair")
        print(f"{'algorithm':>18}" + "".join(f"{c:>12}" for c in heads))
    for dtype in dtypes:
        for density in densities:
            vals, idx = make_problem(n, density, comm.rank, comm.size, "random", dtype, seed=3)
            pair = idx.dtype.itemsize + vals.dtype.itemsize
            for name in names:
                sent = {}
                for wire in ("raw", "compact"):
                    algo = sparsecoll.get_algorithm(name, wire=wire)
                    with comm.measure() as stats:
                        sparsecoll.allreduce(comm, vals, idx, n=n, algorithm=algo)
                    sent[wire] = sum(comm.allgather_object(stats.bytes_sent)) / comm.size
                ratio = sent["compact"] / sent["raw"] if sent["raw"] else float("nan")
                per_pair = "-" if name == "hashed" else round(pair * ratio, 2)
                if comm.rank == 0:
                    cells = (dtype, density, round(sent["raw"]), round(sent["compact"]),
                             round(ratio, 3), per_pair)  # fmt: skip
                    print(f"{name:>18}" + "".join(f"{c!s:>12}" for c in cells))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=size_arg, default=16 * 2**20, help="range length (default 16M)")
    p.add_argument("--densities", type=densities_arg, default=[0.001, 0.01, 0.1, 0.5])
    p.add_argument("--dtypes", default="float32,float64", help="comma list of value dtypes")
    p.add_argument("--values", default="normal,topk", help="comma list: normal, topk")
    p.add_argument("--repeat", type=int_arg(1), default=7, help="timed runs per row")
    p.add_argument("--clock", choices=tuple(CLOCKS), default="cpu", help="cpu or wall time")
    p.add_argument("--collective", action="store_true", help="bytes sent (under mpiexec)")
    p.add_argument("--format", choices=("table", "csv", "json"), default="table")
    args = p.parse_args(argv)
    dtypes = args.dtypes.split(",")
    kinds = args.values.split(",")
    for dt in dtypes:
        if dt not in ("float16", "float32", "float64"):
            p.error(f"argument --dtypes: expecting float16, float32 or float64, got {dt!r}")
    for v in kinds:
        if v not in ("normal", "topk"):
            p.error(f"argument --values: expecting normal or topk, got {v!r}")
    if args.collective:
        return collective(args.n, args.densities, dtypes)
    clock = CLOCKS[args.clock]
    rows = [
        row(args.n, d, dt, v, args.repeat, clock)
        for v in kinds
        for dt in dtypes
        for d in args.densities
    ]
    if args.format == "json":
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    if args.format == "csv":
        print(",".join(COLUMNS))
        for r in rows:
            print(",".join(str(r[c]) for c in COLUMNS))
        return 0
    print(f"# sparsecoll.wire encode/decode, sparsecoll {sparsecoll.__version__}")
    print(f"# n = {args.n}, int32 indices, one core, {args.clock} time")
    print(f"# median of {args.repeat} runs (min apart); GB/s: raw pair bytes per second")
    print("".join(f"{c:>13}" for c in COLUMNS))
    for r in rows:
        print("".join(f"{r[c]!s:>13}" for c in COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
