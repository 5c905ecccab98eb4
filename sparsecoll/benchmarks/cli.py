"""Command-line pieces the benchmarks share: sizes with K/M/G suffixes, --np, rank-0 output.

Sizes are element counts and take binary suffixes, as the OSU suite's ``-m`` does here:
K = 2**10, M = 2**20, G = 2**30 (``64K`` = 65,536, ``25M`` = 26,214,400).
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

__all__ = [
    "RankZeroParser",
    "add_launch_arguments",
    "check_nprocs",
    "launcher_rank",
    "parse_algorithms",
    "parse_size",
    "parse_sizes",
    "size_arg",
    "sizes_arg",
]

SUFFIX = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}
DEFAULT_NPROCS = 4


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


def parse_algorithms(values: list[str] | None, known: list[str]) -> list[str]:
    """Names from repeated/comma-separated ``--algorithm`` values; ``all`` (or none) = all."""
    names: list[str] = []
    for v in values or ["all"]:
        for name in filter(None, (t.strip() for t in v.split(","))):
            for add in known if name == "all" else [name]:
                if add not in known:
                    from ..registry import did_you_mean

                    hint = did_you_mean(add, known)
                    raise ValueError(f"unknown algorithm {add!r}{hint}; known: {', '.join(known)}")
                if add not in names:
                    names.append(add)
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
