"""Command-line pieces the benchmarks share: sizes with K/M/G suffixes, options, rank-0 output.

Sizes are element counts and take binary suffixes, as the OSU suite's ``-m`` does here:
K = 2**10, M = 2**20, G = 2**30 (``64K`` = 65,536, ``25M`` = 26,214,400); a decimal or an
exponent is taken when the count is whole (``1.5M`` = 1,572,864, ``1e6``). :data:`SIZE_HELP`
says so in every size-taking script's ``--help``.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import re
import sys
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from .._launch import under_mpi
from .._options import check_density
from ..registry import algorithm_class, algorithm_options, available_algorithms
from .problems import OVERLAP_HELP, OVERLAPS

__all__ = [
    "DTYPES",
    "SIZE_HELP",
    "RankZeroParser",
    "add_input_arguments",
    "add_launch_arguments",
    "add_timing_arguments",
    "algorithm_arg",
    "bench_parser",
    "check_columns",
    "check_memory",
    "check_nprocs",
    "choices_arg",
    "densities_arg",
    "density_arg",
    "exit_on_any",
    "float_arg",
    "floats_arg",
    "int_arg",
    "ints_arg",
    "launcher_rank",
    "local_ranks",
    "out_arg",
    "parse_algorithms",
    "parse_checked",
    "parse_size",
    "parse_sizes",
    "readable",
    "readable_folder",
    "refuse_unwritable",
    "size_arg",
    "sizes_arg",
    "writable",
]

SUFFIX = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}
DECIMAL_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
DEFAULT_NPROCS = 4
DTYPES = ("float16", "float32", "float64")
SIZE_HELP = (
    "Sizes are element counts: digits, a decimal or an exponent, with an optional suffix "
    "K = 2**10, M = 2**20, G = 2**30, a whole number in all: 4096, 64K, 1.5M (= 1572864), 1e6."
)
_SIZE = re.compile(r"\s*((?:\d+(?:_\d+)*(?:\.\d*)?|\.\d+)(?:e[+-]?\d{1,2})?)\s*([kmg]?)\s*")


def parse_size(text: str, decimal: bool = False) -> int:
    """One size: a number (digits, a decimal, an exponent) with an optional K, M or G suffix
    (powers of 1024; ``decimal``: of 1000), a whole positive count in all: ``64K``, ``1.5M``
    (``1.5`` or ``1.0000001M`` are refused, not rounded)."""
    m = _SIZE.fullmatch(text.lower())
    if not m:
        raise ValueError(f"expecting a size like 4096, 64K or 16M, got {text!r}")
    unit = (DECIMAL_SUFFIX if decimal else SUFFIX)[m.group(2)]
    value = Fraction(m.group(1).replace("_", "")) * unit
    if value.denominator != 1:
        raise ValueError(f"expecting a whole number of elements, got {text!r} = {float(value)!r}")
    if value < 1:
        raise ValueError(f"sizes must be positive, got {text!r}")
    return int(value)


def parse_sizes(text: str, decimal: bool = False) -> list[int]:
    """``MIN:MAX`` (doubling from MIN while <= MAX), ``N``, or a comma list of sizes."""
    if "," in text:
        return [parse_size(t, decimal) for t in text.split(",")]
    if ":" in text:
        lo, hi = (parse_size(t, decimal) for t in text.split(":", 1))
        if lo > hi:
            raise ValueError(f"expecting MIN <= MAX, got {text!r}")
        sizes = []
        while lo <= hi:
            sizes.append(lo)
            lo *= 2
        return sizes
    return [parse_size(text, decimal)]


def size_arg(text: str, decimal: bool = False) -> int:
    """:func:`parse_size` as an argparse ``type`` (its message becomes the usage error)."""
    try:
        return parse_size(text, decimal)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def sizes_arg(text: str, decimal: bool = False) -> list[int]:
    """:func:`parse_sizes` as an argparse ``type``."""
    try:
        return parse_sizes(text, decimal)
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


def ints_arg(low: int) -> Callable[[str], list[int]]:
    """An argparse ``type``: a comma list of integers, each at least ``low``."""
    return lambda text: [int_arg(low)(t) for t in text.split(",")]


def floats_arg(low: float, above: bool = False) -> Callable[[str], list[float]]:
    """An argparse ``type``: a comma list of numbers, each as :func:`float_arg`."""
    return lambda text: [float_arg(low, above)(t) for t in text.split(",")]


def readable(text: str, folder: bool = False) -> Path:
    """An argparse ``type`` for a file a script reads (``folder``: a folder it reads files
    from): a usage error naming the option and the path when it is missing, of the other
    kind or unreadable, before the script starts."""
    kind = "folder" if folder else "file"
    why = None
    if not os.path.exists(text):
        why = f"no such {kind}"
    elif os.path.isdir(text) != folder:
        why = f"not a {kind}"
    elif not os.access(text, os.R_OK | (os.X_OK if folder else 0)):
        why = "permission denied"
    if why:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {why}")
    return Path(text)


def check_columns(
    p: argparse.ArgumentParser, paths: Any, columns: Any, what: str, rows: bool = False
) -> None:
    """A usage error (exit 2) naming the file when a CSV of ``paths`` lacks one of
    ``columns`` in its header (``what``: the kind of CSV the script reads; ``rows``: or
    has no row under it), before the script starts."""
    for path in paths:
        try:
            with open(path, newline="") as f:
                lines = csv.reader(f)
                header, first = next(lines, []), next(lines, None)
        except (UnicodeDecodeError, csv.Error):
            header, first = [], None
        missing = [c for c in columns if c not in header]
        if missing:
            p.error(f"{path} is not {what}: no column {', '.join(missing)}")
        if rows and first is None:
            p.error(f"{path} has no rows")


def readable_folder(text: str) -> Path:
    """:func:`readable` for a folder."""
    return readable(text, folder=True)


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
    (``parents``: the script makes missing folders). Run it as soon as MPI has started,
    so that an unwritable output fails before the run, not after it. Rank 0 decides, the
    others follow: on another host the folder may not exist, and a rank exiting before MPI
    starts would leave the others waiting in MPI_Init."""
    bad: list[Any] = []
    if comm.rank == 0:
        bad = [f for f in paths if f is not None and not writable(f, parents)]
        bad += [d for d in folders if d is not None and not _writable_folder(d, parents)]
    exit_on_any(comm, f"cannot write {bad[0]}" if bad else None)


def exit_on_any(comm: Any, error: str | None) -> None:
    """Exit 2 on every rank when one has an ``error`` (this rank's message, or None), rank
    0 alone printing the first such rank's message as argparse would (naming the rank when
    it is another), so that a failure on one rank (a file it alone cannot read or write)
    never leaves the others waiting. One small allreduce when none has an error."""
    bad = int(comm.allreduce_ints([comm.size if error is None else comm.rank], "min")[0])
    if bad == comm.size:
        return
    message = comm.allgather_object(error)[bad]
    if comm.rank == 0:
        where = f" (on rank {bad})" if bad else ""
        prog = os.path.basename(sys.argv[0])
        print(f"{prog}: error: {message}{where}", file=sys.stderr, flush=True)
    sys.exit(2)


def unknown_algorithm(name: str, known: list[str], what: str = "algorithm") -> str:
    """The message for an unknown algorithm (``what``) ``name``: a did-you-mean and the
    known ones."""
    from ..registry import unknown_name

    return unknown_name(what, name, known)


def choices_arg(known: Any, what: str) -> Callable[[str], list[str]]:
    """An argparse ``type``: a comma list of names from ``known`` (``what``: what a name
    names, in the message), each refused with the known ones, as :func:`algorithm_arg`."""

    def parse(text: str) -> list[str]:
        names = [t.strip() for t in text.split(",")]
        for name in names:
            if name not in known:
                raise argparse.ArgumentTypeError(unknown_algorithm(name, list(known), what))
        return names

    return parse


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
    host's memory, instead of a MemoryError on every rank or the OOM killer."""
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


def wire_variants(names: list[str]) -> list[str]:
    """``names`` and, for each that takes a ``wire`` option, ``NAME:compact`` after it."""
    out: list[str] = []
    for name in names:
        out.append(name)
        if "wire" in algorithm_options(name):
            out.append(f"{name}:compact")
    return out


def build(name: str, n: int, k: int) -> Any:
    """A new instance of ``name`` (``NAME:WIRE``: with that ``wire``) for n and about k."""
    base, _, wire = name.partition(":")
    cls = algorithm_class(base)
    return cls(**cls.default_options(n, k), **({"wire": wire} if wire else {}))


def algorithm_kind(name: str) -> Any:
    """The algorithm class of ``name`` or of ``NAME:WIRE``."""
    return algorithm_class(name.partition(":")[0])


def parse_algorithms(
    values: list[str] | None, known: list[str], option: str = "--algorithm"
) -> list[str]:
    """Names from repeated/comma-separated ``--algorithm`` values (``option``: the option's
    name in the message); ``all`` (or none) = all of ``known`` but the ``NAME:WIRE`` ones."""
    names: list[str] = []
    for v in values or ["all"]:
        for name in filter(None, (t.strip() for t in v.split(","))):
            for add in [k for k in known if ":" not in k] if name == "all" else [name]:
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
        epilog=f"{SIZE_HELP} {epilog}",
    )
    add_launch_arguments(p)
    return p


def add_timing_arguments(
    p: argparse.ArgumentParser,
    iterations: int,
    warmup: int,
    timed: str = "timed calls",
    untimed: str = "untimed calls first (a reused instance: after its settle_calls, the "
    "calls auto measures its contenders in)",
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
    algorithms (``all`` expanded), at least one nonzero per rank (``round(density·n)``, at
    the smallest n), and a dense vector (``dense`` always runs, the baseline)
    that this host's memory can hold on every rank (host buffers: a ``-d cuda`` run's
    vectors live on the GPU). (``-i >= 1``, ``-x >= 0`` and a density in (0, 1] are their
    arguments' types.) Usage errors exit 2 (printed by rank 0 only)."""
    args = p.parse_args(argv)
    check_nprocs(p, args.np)
    try:
        args.algorithm = parse_algorithms(args.algorithm, wire_variants(available_algorithms()))
    except ValueError as exc:
        p.error(str(exc))  # every rank parses the same argv: all exit alike
    sizes = args.message_size if isinstance(args.message_size, list) else [args.message_size]
    n = min(sizes)
    if round(args.density * n) == 0:  # (as density 0: every algorithm ran on empty inputs)
        p.error(
            f"--density {args.density:g} of n = {n} is round({args.density * n:g}) = 0 "
            "nonzeros per rank: nothing to reduce; raise --density or -m"
        )
    if getattr(args, "device", "cpu") == "cpu":
        itemsize = np.dtype(args.dtype).itemsize
        what = "the dense baseline's vector"
        check_memory(p, max(sizes), itemsize, local_ranks(args.np), what)
    return args
