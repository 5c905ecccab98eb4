"""Numba's ``njit`` with its on-disk cache, and a notice when kernels compile.

Every kernel of the package is decorated by :func:`cached_njit`, so it is compiled once per
machine and Python/Numba version, not once per process. Numba keeps the cache beside the
source (``__pycache__``), else (package directory not writable) in the user's cache
directory (``~/.cache/numba``); ``NUMBA_CACHE_DIR`` overrides both. Processes that share a
cache compile each kernel once: on a miss, one takes a lock file beside the cache entry,
compiles and saves; the others (e.g. the other MPI ranks of a first run) wait on the lock,
then load what it saved. A process that compiles one of the package's kernels, or waits
for another's compile, prints one line on stderr, once, on the first MPI rank only (quiet
under pytest, or with ``SPARSECOLL_COMPILE_NOTICE=0``); one that loads every kernel from
the cache prints nothing.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any

__all__ = ["NOTICE", "cached_njit", "compiles"]

NOTICE = "sparsecoll: compiling Numba kernels for first use (cached for later runs)..."
# launcher variables holding this process's rank (the first one set is read)
RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK",
             "PALS_RANKID", "SLURM_PROCID")  # fmt: skip

LOCK_WAIT = 900.0  # seconds a process waits for another's compile of a kernel, at most

_warned = False
_noticed = False
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
            kernel = numba.njit(cache=True, **flags)(fn)
        except RuntimeError as exc:  # (raised by Numba's cache set-up, before any compile)
            _warn_uncached(exc)
            return numba.njit(**flags)(fn)
        _compile_once(kernel)
        return kernel

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
            _notice()

        def on_end(self, ev: Any) -> None:
            # a failed compile added no overload, and no save follows it: let go of the lock
            # (Numba's Event.is_failed reads the other way round in 0.68)
            kernel = ev.data.get("dispatcher")
            cache = getattr(kernel, "_cache", None)
            done = tuple(ev.data.get("args", ())) in getattr(kernel, "overloads", {})
            if isinstance(cache, _OneCompiler) and not done:
                cache.release()

    event.register("numba:compile", Notice())


class _OneCompiler:
    """A dispatcher's on-disk cache, wrapped so that processes sharing it compile once: on
    a miss the lock file is taken and the cache read again; the lock is held until the
    compiled kernel is saved (or its compile fails). Where no lock can be taken (no fcntl,
    a file system without locks) every process compiles, as Numba does alone."""

    def __init__(self, cache: Any, lock_path: str) -> None:
        self._cache, self._lock_path, self._fd = cache, lock_path, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def load_overload(self, sig: Any, target_context: Any) -> Any:
        got = self._cache.load_overload(sig, target_context)
        if got is not None or self._fd is not None:
            return got
        _notice()  # (this process compiles it, or waits while another one does)
        try:
            import fcntl

            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        except (ImportError, OSError):
            return None
        if not _wait_for(fcntl, fd):
            os.close(fd)
            return None
        got = self._cache.load_overload(sig, target_context)  # (saved while we waited?)
        if got is not None:
            os.close(fd)  # (closing it unlocks)
        else:
            self._fd = fd
        return got

    def save_overload(self, sig: Any, data: Any) -> None:
        try:
            self._cache.save_overload(sig, data)
        finally:
            self.release()

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _notice() -> None:
    """Print :data:`NOTICE` once per process (where :func:`_loud`)."""
    global _noticed
    if not _noticed:
        _noticed = True
        if _loud():
            print(NOTICE, file=sys.stderr, flush=True)


def _wait_for(fcntl: Any, fd: int) -> bool:
    """Take the lock on ``fd``, waiting at most LOCK_WAIT seconds (a holder that never lets
    go costs that wait, not a hang); False where it is not taken."""
    deadline = time.monotonic() + LOCK_WAIT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        except OSError:  # (a file system without locks)
            return False


def _compile_once(kernel: Any) -> None:
    """Wrap ``kernel``'s on-disk cache in :class:`_OneCompiler` (where it has one)."""
    from numba.core.caching import Cache

    cache = getattr(kernel, "_cache", None)
    if isinstance(cache, Cache):
        fn = kernel.py_func
        name = f"{fn.__module__}.{fn.__qualname__}.lock".replace("<", "").replace(">", "")
        kernel._cache = _OneCompiler(cache, os.path.join(cache.cache_path, name))


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
