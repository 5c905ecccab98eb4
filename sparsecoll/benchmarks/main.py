"""The main job: every registered algorithm on one problem, each result checked.

Run with ``python -m sparsecoll bench`` (relaunches itself under ``mpiexec -n 4``).
Prints, on rank 0, per algorithm: what its result was checked against and the verdict
(exact algorithms: the dense sum; selecting ones: their own contract, since they keep
only part of the sum), the median latency, the speed-up over dense, bytes sent per rank
and their ratio to dense.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import zlib
from typing import Any

import numpy as np

from .. import __version__
from .._array import cupy_or_none, is_device_array, to_host
from ..algorithms.base import reference_sum
from ..comm import CommStats, Communicator, mpi_library_version
from ..registry import algorithm_class
from ..sparse import SparseVector, coalesce
from .cli import (
    add_input_arguments,
    add_timing_arguments,
    bench_parser,
    parse_checked,
    size_arg,
)
from .problems import make_problem

__all__ = [
    "Timing",
    "build_parser",
    "gather_inputs",
    "main",
    "parse_args",
    "run",
    "run_algorithm",
    "time_algorithm",
    "verify_all",
]


def build_parser() -> argparse.ArgumentParser:
    p = bench_parser(
        "python -m sparsecoll bench", __doc__, "Other suites: python -m sparsecoll bench osu --help"
    )
    p.add_argument(
        "-m",
        "--message-size",
        type=size_arg,
        default=4 * 2**20,
        metavar="N",
        help="dense length n, in elements (default 4M)",
    )
    add_input_arguments(p)
    add_timing_arguments(p, 10, 2)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the arguments (usage errors exit 2, printed by rank 0 only)."""
    return parse_checked(build_parser(), argv)


@dataclasses.dataclass
class Timing:
    """What :func:`time_algorithm` measured on this rank."""

    result: SparseVector  # the last call's result
    times: list[float]  # this rank's seconds per timed call
    stats: CommStats  # this rank's counts for the last timed call


def time_algorithm(
    comm: Communicator,
    name: str,
    vals: Any,
    idx: Any,
    n: int,
    k: int,
    iters: int,
    warmup: int,
    reuse: bool = False,
) -> Timing:
    """Time ``iters`` calls (after ``warmup``) of ``sparsecoll.allreduce`` with one algorithm.

    Each call starts after a barrier and is timed with ``MPI.Wtime`` on every rank (device
    work is synchronized before the clock stops). The algorithm is built from its
    ``default_options(n, k)``: a fresh instance per call, or one instance for every call
    when ``reuse`` (stateful algorithms then run in steady state, as in training).
    """
    from ..api import allreduce

    cls = algorithm_class(name)
    algo = cls(**cls.default_options(n, k))
    times: list[float] = []
    out = None
    for it in range(warmup + iters):
        if not reuse and it:
            algo = cls(**cls.default_options(n, k))
        comm.barrier()
        t0 = comm.wtime()
        out = allreduce(comm, vals, idx, n=n, algorithm=algo)
        if is_device_array(out.values):
            cupy_or_none().cuda.get_current_stream().synchronize()
        dt = comm.wtime() - t0
        if it >= warmup:
            times.append(dt)
    return Timing(out, times, out.info["stats"])


def gather_inputs(comm: Communicator, vals: Any, idx: Any, n: int) -> list[SparseVector]:
    """Every rank's coalesced input, on every rank, on the host (for ``verify``)."""
    local = coalesce(to_host(idx), to_host(vals), n)
    return [SparseVector(i, v, n) for i, v in comm.allgather_object((local.indices, local.values))]


def verify_all(
    comm: Communicator,
    name: str,
    result: SparseVector,
    reference: SparseVector,
    inputs: list[SparseVector],
    n: int,
    k: int,
) -> bool:
    """Whether every rank holds the same ``result`` and it meets the algorithm's contract
    (``reference``: :func:`~sparsecoll.algorithms.base.reference_sum` of ``inputs``).

    Collective. Ranks compare a checksum of their result; rank 0 alone runs the (costly)
    ``verify`` and the verdict is shared, so checking costs one rank's time, not P's.
    """
    digest = zlib.crc32(np.ascontiguousarray(to_host(result.indices)).view(np.uint8))
    digest = zlib.crc32(np.ascontiguousarray(to_host(result.values)).view(np.uint8), digest)
    ok = True
    if comm.rank == 0:
        cls = algorithm_class(name)
        ok = cls(**cls.default_options(n, k)).verify(result, reference, inputs)
    agreed = comm.allreduce_ints([0 if ok else 1, digest, -digest], "max")
    return bool(agreed[0] == 0 and agreed[1] == -agreed[2])


def run_algorithm(
    comm: Communicator, name: str, vals: Any, idx: Any, n: int, k: int, iters: int, warmup: int
) -> tuple[SparseVector, list[float], int]:
    """Time one algorithm (see :func:`time_algorithm`).

    Returns (last result, per-iteration max-over-ranks seconds, bytes sent per rank per call).
    """
    t = time_algorithm(comm, name, vals, idx, n, k, iters, warmup)
    times = comm.allreduce_floats(t.times, "max").tolist() if t.times else []
    return t.result, times, t.stats.bytes_sent


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run (under mpiexec); exit code 0 when every result checked out."""
    return run(parse_args(argv))


def check_label(name: str) -> str:
    """What the ``check`` column compares with: the dense sum, or the algorithm's contract."""
    return "sum" if algorithm_class(name).exact else "contract"


def _print_header(size: int, n: int, args: argparse.Namespace, dtype: np.dtype, k: int) -> None:
    """The table's legend and column titles (rank 0, before the first row)."""
    print(f"# sparsecoll {__version__} bench: {mpi_library_version()}")
    print(
        f"# P={size} n={n} density={args.density} overlap={args.overlap} "
        f"dtype={dtype} k/rank={k} iterations={args.iterations} warmup={args.warmup}"
    )
    print(
        "# check: 'sum' = equals the exact dense sum; 'contract' = meets the selecting "
        "algorithm's contract (about k entries: docs/selecting.md)"
    )
    print(
        "# bytes/rank: payload bytes sent per call by the busiest rank (metadata, such as "
        "counts and input checks, not included)"
    )
    print(
        "# median ms: median over the timed calls of the slowest rank's time; "
        "speedup = dense median / median; bytes ratio = bytes/rank / dense bytes/rank"
    )
    print(
        f"{'algorithm':<20}{'check':>14}{'median ms':>12}{'speedup':>10}"
        f"{'bytes/rank':>14}{'bytes ratio':>13}{'result nnz':>12}"
    )
    sys.stdout.flush()


def run(args: argparse.Namespace) -> int:
    """The main job on parsed arguments; rank 0 prints the table."""
    comm = Communicator()
    n, dtype = args.message_size, np.dtype(args.dtype)
    vals, idx = make_problem(n, args.density, comm.rank, comm.size, args.overlap, dtype)
    k = round(args.density * n)
    names = args.algorithm
    inputs = gather_inputs(comm, vals, idx, n)
    reference = reference_sum(inputs)  # built apart from every algorithm, dense included
    rows = []
    if comm.rank == 0:
        _print_header(comm.size, n, args, dtype, k)
    for name in ["dense", *[a for a in names if a != "dense"]]:
        out, times, sent = run_algorithm(comm, name, vals, idx, n, k, args.iterations, args.warmup)
        ok = verify_all(comm, name, out, reference, inputs, n, k)
        sent_max = int(comm.allreduce_ints([sent], "max")[0])
        rows.append((name, ok, float(np.median(times)), sent_max, out.nnz))
        if comm.rank == 0:  # each row as soon as it is measured: a long run shows progress
            _, _, dense_t, dense_bytes, _ = rows[0]  # dense always runs first: the reference
            t, b, nnz = rows[-1][2:]
            check = f"{check_label(name)} {'ok' if ok else 'FAIL'}"
            speed = f"{dense_t / t:.2f}x" if t > 0 else "-"
            ratio = f"{b / dense_bytes:.3f}" if dense_bytes else "-"
            print(f"{name:<20}{check:>14}{t * 1e3:>12.2f}{speed:>10}{b:>14}{ratio:>13}{nnz:>12}")
            sys.stdout.flush()
    return 0 if all(r[1] for r in rows) else 1
