"""Command-line pieces the benchmarks share: sizes with K/M/G suffixes, options, rank-0 output.

Sizes are element counts and take binary suffixes, as the OSU suite's ``-m`` does here:
K = 2**10, M = 2**20, G = 2**30 (``64K`` = 65,536, ``25M`` = 26,214,400).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .._launch import under_mpi
from .._options import check_density
from ..registry import available_algorithms
from .problems import OVERLAP_HELP, OVERLAPS

__all__ = [
    "DTYPES",
    "RankZeroParser",
    "add_input_arguments",
    "add_launch_arguments",
    "add_timing_arguments",
    "algorithm_arg",
    "bench_parser",
    "check_memory",
    "check_nprocs",
    "densities_arg",
    "density_arg",
    "float_arg",
    "int_arg",
    "launcher_rank",
    "local_ranks",
    "out_arg",
    "parse_algorithms",
    "parse_checked",
    "parse_size",
    "parse_sizes",
    "refuse_unwritable",
    "size_arg",
    "sizes_arg",
    "writable",
]

SUFFIX = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}
DEFAULT_NPROCS = 4
DTYPES = ("float16", "float32", "float64")


def parse_size(text: str) -> int:
    """One size: digits with an optional K, M or G suffix (powers of 1024), e.g. ``64K``."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmg]?)\s*", text.lower())
    if not m:
        raise ValueError(f"expecting a size like 4096, 64K or 16M, got {text!r}")
    size = int(m.group(1)) * SUFFIX[m.group(2)]
    if size < 1:
        raise ValueError(f"sizes must be positive, got {text!r}")
    return size


def parse_sizes(text: str) -> list[int]:
    """``MIN:MAX`` (doubling from MIN while <= MAX), ``N``, or a comma list of sizes."""
    if "," in text:
        return [parse_size(t) for t in text.split(",")]
    if ":" in text:
        lo, hi = (parse_size(t) for t in text.split(":", 1))
        if lo > hi:
            raise ValueError(f"expecting MIN <= MAX, got {text!r}")
        sizes = []
        while lo <= hi:
            sizes.append(lo)
            lo *= 2
        return sizes
    return [parse_size(text)]


def size_arg(text: str) -> int:
    """:func:`parse_size` as an argparse ``type`` (its message becomes the usage error)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def sizes_arg(text: str) -> list[int]:
    """:func:`parse_sizes` as an argparse ``type``."""
    try:
        return parse_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def density_arg(text: str) -> float:
    """A density (a real number in (0, 1]: nonzeros / n) as an argparse ``type``: 0 left
    nothing to send, nan, inf and > 1 no meaning."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expecting a density in (0, 1], got {text!r}") from None
    try:
        return check_density(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def densities_arg(text: str) -> list[float]:
    """A comma list of densities (each as :func:`density_arg`) as an argparse ``type``."""
    return [density_arg(t) for t in text.split(",")]


def int_arg(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer at least ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"expecting an integer >= {low}, got {text!r}")
        return value

    return parse


def float_arg(low: float, above: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite real number at least ``low`` (``above``: greater than
    ``low``; nan and inf refused)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (math.isfinite(value) and (value > low if above else value >= low)):
            sign = ">" if above else ">="
            raise argparse.ArgumentTypeError(f"expecting a number {sign} {low:g}, got {text!r}")
        return value

    return parse


def writable(path: str | os.PathLike, parents: bool = False) -> bool:
    """Whether a file can be created (or overwritten) at ``path``: the path, if present, is
    a writable file, else its folder exists and takes new files (``parents``: or the
    nearest folder above it that exists does, the script making the missing ones)."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        return os.path.isfile(path) and os.access(path, os.W_OK)
    folder = os.path.dirname(path)
    while parents and not os.path.exists(folder) and folder != os.path.dirname(folder):
        folder = os.path.dirname(folder)
    return os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK)


def out_arg(parents: bool = False, folder: bool = False) -> Callable[[str], Path]:
    """An argparse ``type`` for a file a single-process script writes: refused (a usage
    error) unless :func:`writable` (``folder``: a folder the script writes files into, an
    existing one or one it makes when ``parents``). MPI scripts check on rank 0 instead,
    with :func:`refuse_unwritable`: another host may lack the folder."""

    def parse(text: str) -> Path:
        if not (_writable_folder(text, parents) if folder else writable(text, parents)):
            raise argparse.ArgumentTypeError(f"cannot write {text}")
        return Path(text)

    return parse


def _writable_folder(path: str | os.PathLike, parents: bool) -> bool:
    """Whether files can be written into the folder ``path`` (made first when ``parents``)."""
    if os.path.exists(path):
        return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)
    return parents and writable(path, parents=True)


def refuse_unwritable(comm: Any, paths: list[Any], folders: list[Any] = (), parents=False):
    """Exit 2 on every rank (rank 0 alone prints, as argparse would) when rank 0, the rank
    that writes them, cannot write one of ``paths`` (files) or into one of ``folders``
    (``parents``: the script makes missing folders). Run it as soon as MPI has started:
    an output that cannot be written used to fail once the whole run was done. (Rank 0
    decides, the others follow: on another host the folder may not exist, and a rank
    exiting before MPI starts leaves the others waiting in MPI_Init.)"""
    bad: list[Any] = []
    if comm.rank == 0:
        bad = [f for f in paths if f is not None and not writable(f, parents)]
        bad += [d for d in folders if d is not None and not _writable_folder(d, parents)]
    if comm.allreduce_ints([len(bad)], "max")[0]:
        if comm.rank == 0:
            prog = os.path.basename(sys.argv[0])
            print(f"{prog}: error: cannot write {bad[0]}", file=sys.stderr, flush=True)
        sys.exit(2)


def unknown_algorithm(name: str, known: list[str]) -> str:
    """The message for an unknown algorithm ``name``: a did-you-mean and the known ones."""
    from ..registry import did_you_mean

    return f"unknown algorithm {name!r}{did_you_mean(name, known)}; known: {', '.join(known)}"


def algorithm_arg(text: str) -> str:
    """One registered algorithm's name as an argparse ``type``."""
    known = available_algorithms()
    if text not in known:
        raise argparse.ArgumentTypeError(unknown_algorithm(text, known))
    return text


def local_ranks(nprocs: int) -> int:
    """Ranks on this host: the launcher's count under mpiexec, else ``nprocs`` (a relaunch
    starts them all here)."""
    for var in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1 if under_mpi() else nprocs


def check_memory(p: argparse.ArgumentParser, n: int, itemsize: int, ranks: int, what: str) -> None:
    """A usage error (exit 2) when ``ranks`` copies of ``n`` elements of ``itemsize`` bytes
    (``what``: the array every rank must hold, a lower bound of its memory) exceed this
    host's memory: 2**40 elements used to end in a MemoryError traceback on every rank, or
    an allocation that only the OOM killer stopped."""
    need = n * itemsize * ranks
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # (not known here: nothing to check)
        return
    if need > have:
        gib = 2.0**30
        p.error(
            f"n = {n} is too large for this host's {have / gib:.1f} GiB of memory: {what}, "
            f"n x {itemsize} B = {n * itemsize / gib:.1f} GiB per rank, "
            f"{need / gib:.1f} GiB for {ranks} rank(s)"
        )


def parse_algorithms(
    values: list[str] | None, known: list[str], option: str = "--algorithm"
) -> list[str]:
    """Names from repeated/comma-separated ``--algorithm`` values (``option``: the option's
    name in the message); ``all`` (or none) = all."""
    names: list[str] = []
    for v in values or ["all"]:
        for name in filter(None, (t.strip() for t in v.split(","))):
            for add in known if name == "all" else [name]:
                if add not in known:
                    raise ValueError(unknown_algorithm(add, known))
                if add not in names:
                    names.append(add)
    if not names:  # osu would print nothing, the main job dense alone
        raise ValueError(f"expecting algorithm names or 'all', got {option} {values[0]!r}")
    return names


def launcher_rank() -> int:
    """This process's rank from the MPI launcher's environment (0 outside mpiexec)."""
    for var in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


class RankZeroParser(argparse.ArgumentParser):
    """An ArgumentParser that prints only on rank 0: every rank parses the same argv and
    exits alike, so help and usage errors appear once, not once per rank."""

    def _print_message(self, message: str, file: Any = None) -> None:
        if launcher_rank() == 0:
            super()._print_message(message, file)


class _Ambiguous(argparse.Action):
    """``-n`` is the rank count to mpiexec: refuse it rather than guess what was meant."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None):
        parser.error(
            "-n is ambiguous here: use --np P for the number of ranks, "
            "-m/--message-size for the vector length"
        )


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    """``--np`` (ranks to relaunch under mpiexec with) and the ``-n`` trap."""
    p.add_argument(
        "--np",
        type=int,
        default=DEFAULT_NPROCS,
        metavar="P",
        help=f"ranks to start under mpiexec (default {DEFAULT_NPROCS}); "
        "ignored when already started by mpiexec",
    )
    p.add_argument("-n", action=_Ambiguous, help=argparse.SUPPRESS)


def check_nprocs(p: argparse.ArgumentParser, nprocs: int) -> None:
    """A usage error (exit 2) unless ``--np`` is at least 1."""
    if nprocs < 1:
        p.error(f"expecting --np >= 1, got {nprocs}")


def bench_parser(prog: str, doc: str, epilog: str) -> RankZeroParser:
    """A ``python -m sparsecoll bench`` suite's parser (the first paragraph of ``doc`` its
    description), with :func:`add_launch_arguments` and the size suffixes in its epilog."""
    p = RankZeroParser(
        prog=prog,
        description=doc.split("\n\n")[0],
        epilog=f"Sizes take binary suffixes: K = 2**10, M = 2**20, G = 2**30. {epilog}",
    )
    add_launch_arguments(p)
    return p


def add_timing_arguments(
    p: argparse.ArgumentParser,
    iterations: int,
    warmup: int,
    timed: str = "timed calls",
    untimed: str = "untimed calls first",
) -> None:
    """``-i/--iterations`` and ``-x/--warmup`` with these defaults (help: ``timed`` and
    ``untimed``, then the default)."""
    p.add_argument(
        "-i",
        "--iterations",
        type=int_arg(1),
        default=iterations,
        help=f"{timed} (default %(default)s)",
    )
    p.add_argument(
        "-x", "--warmup", type=int_arg(0), default=warmup, help=f"{untimed} (default %(default)s)"
    )


def add_input_arguments(p: argparse.ArgumentParser) -> None:
    """What the allreduce benchmarks run on: ``--algorithm`` (checked by
    :func:`parse_algorithms`), ``--density``, ``--overlap`` and ``--dtype``."""
    p.add_argument(
        "--algorithm",
        action="append",
        metavar="NAME[,NAME]",
        help="algorithms to run (repeatable, comma lists, 'all'; default all)",
    )
    p.add_argument(
        "--density", type=density_arg, default=0.01, help="nonzeros per rank / n (default 0.01)"
    )
    p.add_argument("--overlap", choices=OVERLAPS, default="random", help=OVERLAP_HELP)
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="(default float32)")


def parse_checked(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv`` with a suite's parser (:func:`bench_parser`, :func:`add_input_arguments`,
    :func:`add_timing_arguments`) and check what argparse does not: ``--np >= 1``, known
    algorithms (``all`` expanded), and a dense vector (``dense`` always runs, the baseline)
    that this host's memory can hold on every rank (host buffers: a ``-d cuda`` run's
    vectors live on the GPU). (``-i >= 1``, ``-x >= 0`` and a density in (0, 1] are their
    arguments' types.) Usage errors exit 2 (printed by rank 0 only)."""
    args = p.parse_args(argv)
    check_nprocs(p, args.np)
    try:
        args.algorithm = parse_algorithms(args.algorithm, available_algorithms())
    except ValueError as exc:
        p.error(str(exc))  # every rank parses the same argv: all exit alike
    if getattr(args, "device", "cpu") == "cpu":
        sizes = args.message_size if isinstance(args.message_size, list) else [args.message_size]
        itemsize = np.dtype(args.dtype).itemsize
        what = "the dense baseline's vector"
        check_memory(p, max(sizes), itemsize, local_ranks(args.np), what)
    return args
