"""The main job: every registered algorithm on one problem, each result checked.

Run with ``python -m sparsecoll bench`` (relaunches itself under ``mpiexec -n 4``).
Every algorithm is timed in steady state: one instance per algorithm, reused for the
warm-up and the timed calls, as training reuses it. Prints, on rank 0, the network it ran
on and per algorithm: what its result was checked against and the verdict (exact
algorithms: the dense sum; selecting ones: their own contract, since they keep only part
of the sum), the median latency, the speed-up over dense, bytes and messages sent per rank,
and the time the same call is projected to take on a 1 and a 10 Gbit/s link (α-β model,
:data:`PROJECTED`); ``auto`` names its pick.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import socket
import sys
import zlib
from collections.abc import Iterable
from typing import Any

import numpy as np

from .. import __version__
from .._array import cupy_or_none, is_device_array, to_host
from ..algorithms.base import reference_sum
from ..comm import CommStats, Communicator, mpi_library_version
from ..sparse import SparseVector, coalesce
from .cli import (
    add_input_arguments,
    add_timing_arguments,
    algorithm_kind,
    bench_parser,
    build,
    parse_checked,
    size_arg,
)
from .model import LINKS, Link, check_messages
from .problems import make_problem

__all__ = [
    "PROJECTED",
    "Timing",
    "build_parser",
    "gather_inputs",
    "main",
    "network",
    "parse_args",
    "run",
    "run_algorithm",
    "time_algorithm",
    "time_calls",
    "verify_all",
]

# the links each row is projected onto: 1 GbE as the model's preset, 10 GbE (TCP) with a
# fifth of its per-message latency
PROJECTED = (LINKS["1gbe"], Link("10 Gbit/s Ethernet", 10e-6, 1.25e9))


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
    picks: list[str] = dataclasses.field(default_factory=list)  # auto's, per timed call


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
    when ``reuse`` (stateful algorithms then run in steady state, as in training: the
    instance's ``settle_calls``, auto's measuring of its contenders, come before the
    ``warmup`` calls, so that its pick has as many untimed calls of its own as any
    algorithm timed alone).
    """
    algo = build(name, n, k)
    if reuse:
        warmup += algo.settle_calls
        algos: Iterable = itertools.repeat(algo, warmup + iters)
    else:
        algos = itertools.chain([algo], (build(name, n, k) for _ in range(warmup + iters - 1)))
    return time_calls(comm, algos, vals, idx, n, warmup)


def time_calls(
    comm: Communicator, algos: Iterable, vals: Any, idx: Any, n: int, skip: int = 0
) -> Timing:
    """One call of ``sparsecoll.allreduce`` with each instance of ``algos`` in turn (one
    instance may come again), each timed as :func:`time_algorithm` says; the first ``skip``
    calls are left out of the times and picks (at least one call)."""
    from ..api import allreduce

    times: list[float] = []
    picks: list[str] = []
    out = None
    for it, algo in enumerate(algos):
        out = None  # (the last result freed before the clock starts, not in the call timed)
        comm.barrier()
        t0 = comm.wtime()
        out = allreduce(comm, vals, idx, n=n, algorithm=algo)
        if is_device_array(out.values):
            cupy_or_none().cuda.get_current_stream().synchronize()
        dt = comm.wtime() - t0
        if it >= skip:
            times.append(dt)
            if "auto_choice" in out.info:
                picks.append(out.info["auto_choice"])
    return Timing(out, times, out.info["stats"], picks)


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
        ok = build(name, n, k).verify(result, reference, inputs)
    agreed = comm.allreduce_ints([0 if ok else 1, digest, -digest], "max")
    return bool(agreed[0] == 0 and agreed[1] == -agreed[2])


def run_algorithm(
    comm: Communicator, name: str, vals: Any, idx: Any, n: int, k: int, iters: int, warmup: int
) -> tuple[SparseVector, list[float], int, list[str]]:
    """Time one algorithm in steady state (one instance for every call; see
    :func:`time_algorithm`).

    Returns (last result, per-iteration max-over-ranks seconds, bytes sent per rank per call,
    auto's pick in each timed call).
    """
    t = time_algorithm(comm, name, vals, idx, n, k, iters, warmup, reuse=True)
    times = comm.allreduce_floats(t.times, "max").tolist() if t.times else []
    return t.result, times, t.stats.bytes_sent, t.picks


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run (under mpiexec); exit code 0 when every result checked out."""
    return run(parse_args(argv))


def check_label(name: str) -> str:
    """What the ``check`` column compares with: the dense sum, or the algorithm's contract."""
    return "sum" if algorithm_kind(name).exact else "contract"


def network(comm: Communicator) -> str:
    """The network the ranks talk over, as the header names it (collective)."""
    hosts = comm.allgather_object(socket.gethostname())
    if len(set(hosts)) > 1:
        return f"{len(set(hosts))} hosts, {comm.size} ranks: the MPI library's transport"
    cores = os.cpu_count() or 1
    over = ": oversubscribed" if comm.size > cores else ""
    return f"shared memory, one host ({comm.size} ranks on {cores} cores{over})"


def projected_ms(link: Link, median: float, nbytes: int, messages: int) -> float:
    """A row's projected milliseconds on ``link``: its time here plus the time its messages
    and bytes sent per rank take on the link (α·messages + β·bytes, β = 1/bandwidth)."""
    return (median + link.time(messages, nbytes)) * 1e3


def _print_header(
    size: int, n: int, args: argparse.Namespace, dtype: np.dtype, k: int, net: str
) -> None:
    """The table's legend and column titles (rank 0, before the first row)."""
    print(f"# sparsecoll {__version__} bench: {mpi_library_version()}")
    print(
        f"# P={size} n={n} density={args.density} overlap={args.overlap} "
        f"dtype={dtype} k/rank={k} iterations={args.iterations} warmup={args.warmup}"
    )
    print(f"# network: {net}")
    print(
        "# steady state: one instance per algorithm, reused for the warm-up and the timed "
        "calls, on the same input every call, as training reuses it (oktopk: threshold and "
        "regions; exdyna: threshold window; auto: learned overlap)"
    )
    print(
        "# check: 'sum' = equals the exact dense sum; 'contract' = meets the selecting "
        "algorithm's contract (about k entries: docs/guide/algorithms.md); auto (X): auto picked X"
    )
    print(
        "# bytes/rank, msgs: payload bytes and messages sent per call by the busiest rank "
        "(msgs with metadata and the input check; bytes without)"
    )
    print(
        "# median ms: median over the timed calls of the slowest rank's time; "
        "speedup = dense median / median; bytes ratio = bytes/rank / dense bytes/rank"
    )
    links = "; ".join(
        f"{tag}: alpha = {link.alpha * 1e6:g} us/message, beta = {1e9 / link.bandwidth:g} "
        f"ns/byte ({link.bandwidth / 1e6:g} MB/s)"
        for tag, link in zip(("1G", "10G"), PROJECTED)
    )
    print(
        f"# 1G ms, 10G ms: projected on a 1 and a 10 Gbit/s link, median ms + alpha*msgs "
        f"+ beta*bytes (bytes with metadata; {links}; the alpha-beta model of "
        f"sparsecoll.benchmarks.model)"
    )
    print(
        f"{'algorithm':<26}{'check':>13}{'median ms':>11}{'speedup':>9}{'bytes/rank':>12}"
        f"{'bytes ratio':>13}{'msgs':>6}{'1G ms':>9}{'10G ms':>9}{'result nnz':>12}"
    )
    sys.stdout.flush()


def _label(name: str, picks: list[str]) -> str:
    """The row's name: auto's with the algorithms it picked in the timed calls."""
    return f"{name} ({'/'.join(dict.fromkeys(picks))})" if picks else name


def run(args: argparse.Namespace) -> int:
    """The main job on parsed arguments; rank 0 prints the table."""
    comm = Communicator()
    n, dtype = args.message_size, np.dtype(args.dtype)
    vals, idx = make_problem(n, args.density, comm.rank, comm.size, args.overlap, dtype)
    k = round(args.density * n)
    names = args.algorithm
    inputs = gather_inputs(comm, vals, idx, n)
    reference = reference_sum(inputs)  # built apart from every algorithm, dense included
    net = network(comm)
    rows = []
    if comm.rank == 0:
        _print_header(comm.size, n, args, dtype, k, net)
    for name in ["dense", *[a for a in names if a != "dense"]]:
        t = time_algorithm(comm, name, vals, idx, n, k, args.iterations, args.warmup, reuse=True)
        times = comm.allreduce_floats(t.times, "max").tolist()
        ok = verify_all(comm, name, t.result, reference, inputs, n, k)
        s = t.stats
        counts = [s.bytes_sent, s.bytes_sent + s.meta_bytes_sent]
        counts.append(s.messages_sent + s.meta_messages_sent)
        sent, sent_all, msgs = comm.allreduce_ints(counts, "max").tolist()
        msgs += check_messages(comm.size)  # (the input check, outside the counted window)
        rows.append((name, ok, float(np.median(times)), sent, t.result.nnz))
        if comm.rank == 0:  # each row as soon as it is measured: a long run shows progress
            _, _, dense_t, dense_bytes, _ = rows[0]  # dense always runs first: the reference
            t_med, b, nnz = rows[-1][2:]
            check = f"{check_label(name)} {'ok' if ok else 'FAIL'}"
            speed = f"{dense_t / t_med:.2f}x" if t_med > 0 else "-"
            ratio = f"{b / dense_bytes:.3f}" if dense_bytes else "-"
            far = [projected_ms(link, t_med, sent_all, msgs) for link in PROJECTED]
            print(
                f"{_label(name, t.picks):<26}{check:>13}{t_med * 1e3:>11.2f}{speed:>9}{b:>12}"
                f"{ratio:>13}{msgs:>6}{far[0]:>9.2f}{far[1]:>9.2f}{nnz:>12}"
            )
            sys.stdout.flush()
    return 0 if all(r[1] for r in rows) else 1
