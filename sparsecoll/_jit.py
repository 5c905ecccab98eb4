"""Numba's ``njit`` with its on-disk cache, and a notice when kernels compile.

Every kernel of the package is decorated by :func:`cached_njit`, so it is compiled once per
machine and Python/Numba version, not once per process: later runs, and the other MPI ranks
of a job once one rank has saved it, load the machine code from the cache. Numba keeps the
cache beside the source (``__pycache__``), else (package directory not writable) in the
user's cache directory (``~/.cache/numba``); ``NUMBA_CACHE_DIR`` overrides both. A process
that compiles one of the package's kernels prints one line on stderr, once, on the first
MPI rank only (quiet under pytest, or with ``SPARSECOLL_COMPILE_NOTICE=0``); a process that
loads every kernel from the cache prints nothing.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

__all__ = ["NOTICE", "cached_njit", "compiles"]

NOTICE = "sparsecoll: compiling Numba kernels for first use (cached for later runs)..."
# launcher variables holding this process's rank (the first one set is read)
RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK",
             "PALS_RANKID", "SLURM_PROCID")  # fmt: skip

_warned = False
_listening = False
_compiles = 0  # the package's kernels compiled by this process (cache hits excluded)


def compiles() -> int:
    """How many of the package's kernels this process has compiled (not loaded from the
    cache)."""
    return _compiles


def cached_njit(**flags: Any) -> Any:
    """``numba.njit(cache=True, **flags)``; where Numba finds no cache directory it can write,
    ``numba.njit(**flags)`` and one warning.

    With both the source directory and the user's cache directory read-only (an installed
    package in a container with a read-only root, ``HOME`` not writable) ``njit(cache=True)``
    raises ``RuntimeError: cannot cache function ...: no locator available`` when the
    function is decorated; the kernels are then compiled in each process instead.
    """
    import numba

    _listen()

    def decorate(fn: Any) -> Any:
        try:
            return numba.njit(cache=True, **flags)(fn)
        except RuntimeError as exc:  # (raised by Numba's cache set-up, before any compile)
            _warn_uncached(exc)
            return numba.njit(**flags)(fn)

    return decorate


def _listen() -> None:
    """Count the package's compiles, and print :data:`NOTICE` at the first (Numba fires
    ``numba:compile`` only on a cache miss)."""
    global _listening
    if _listening:
        return
    _listening = True
    from numba.core import event

    class Notice(event.Listener):
        def on_start(self, ev: Any) -> None:
            global _compiles
            fn = getattr(ev.data.get("dispatcher"), "py_func", None)
            if not getattr(fn, "__module__", "").startswith(f"{__package__}."):
                return
            _compiles += 1
            if _compiles == 1 and _loud():
                print(NOTICE, file=sys.stderr, flush=True)

        def on_end(self, ev: Any) -> None:
            pass

    event.register("numba:compile", Notice())


def _loud() -> bool:
    """Whether the notice is printed: not under pytest (its children included), not with
    ``SPARSECOLL_COMPILE_NOTICE=0``, and only on the first rank of an MPI job."""
    env = os.environ
    if "PYTEST_CURRENT_TEST" in env or env.get("SPARSECOLL_COMPILE_NOTICE", "1").strip() == "0":
        return False
    rank = next((env[v] for v in RANK_VARS if env.get(v, "").strip()), "0")
    return rank.strip() == "0"


def _warn_uncached(exc: RuntimeError) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        f"sparsecoll: Numba cannot cache the compiled kernels ({exc}); they are compiled "
        "again in every process. Set NUMBA_CACHE_DIR to a writable directory to keep them",
        RuntimeWarning,
        stacklevel=4,
    )
