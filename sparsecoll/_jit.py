"""Numba's ``njit`` with its on-disk cache where Numba can write one, without it elsewhere."""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["cached_njit"]

_warned = False


def cached_njit(**flags: Any) -> Any:
    """``numba.njit(cache=True, **flags)``; where Numba finds no cache directory it can write,
    ``numba.njit(**flags)`` and one warning.

    Numba keeps the cache beside the source (``__pycache__``), else in the user's cache
    directory (``~/.cache/numba``); with both read-only (an installed package in a container
    with a read-only root, ``HOME`` not writable) ``njit(cache=True)`` raises ``RuntimeError:
    cannot cache function ...: no locator available`` when the function is decorated, and
    every call of the library that compiles a kernel failed with it. The kernels are then
    compiled in each process instead.
    """
    import numba

    def decorate(fn: Any) -> Any:
        try:
            return numba.njit(cache=True, **flags)(fn)
        except RuntimeError as exc:  # (raised by Numba's cache set-up, before any compile)
            _warn_uncached(exc)
            return numba.njit(**flags)(fn)

    return decorate


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
