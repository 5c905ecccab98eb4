"""What sparsecoll hangs on an MPI communicator, as MPI attributes (so that every
Communicator wrapping it shares them): its progress engine, the lock that runs this rank's
calls on it one at a time, the duplicate its messages travel on (:func:`apart`), and the
measured speed of its links (:func:`link_constants`).

When the user frees the communicator, MPI deletes its attributes: the engine finishes its
queue and frees its own duplicates, and the message duplicate is freed, except on
COMM_WORLD and COMM_SELF, whose attributes go inside MPI_Finalize, where nothing may be
freed. MPI_Finalize first deletes COMM_SELF's attributes: there, every engine completes its
pending calls (:func:`stop_at_finalize`) while MPI still works.
"""

from __future__ import annotations

import threading
from typing import Any

from . import _mpilib
from ._progress import stop

__all__ = [
    "apart",
    "attach_engine",
    "attached_engine",
    "link_constants",
    "serial_lock",
    "stop_at_finalize",
]

_KEYVAL_LOCK = threading.Lock()  # (never held during communication)
_ENGINE_KEYVAL: int | None = None  # MPI attribute key of the progress engine
_SERIAL_KEYVAL: int | None = None  # ... of the lock of Communicator.serial
_APART_KEYVAL: int | None = None  # ... of a communicator's message duplicate
_LINK_KEYVAL: int | None = None  # ... of its links' measured speed
_FINALIZE_KEYVAL: list[int] = []


def attached_engine(comm: Any) -> Any:
    """The progress engine attached to the MPI communicator ``comm`` (None: none yet)."""
    if _ENGINE_KEYVAL is None:  # (no engine anywhere)
        return None
    return comm.Get_attr(_ENGINE_KEYVAL)


def attach_engine(comm: Any, engine: Any) -> None:
    """Attach ``engine`` to ``comm`` (one attached before is closed: see _engine_deleted)."""
    global _ENGINE_KEYVAL
    with _KEYVAL_LOCK:
        if _ENGINE_KEYVAL is None:
            _ENGINE_KEYVAL = _mpilib.mpi().Comm.Create_keyval(delete_fn=_engine_deleted)
    comm.Set_attr(_ENGINE_KEYVAL, engine)


def _engine_deleted(comm: Any, keyval: int, engine: Any) -> None:
    # the engine finishes its queue, frees its duplicates (_freeable) and ends; no waiting
    # here, inside MPI_Comm_free
    engine.close(wait=False, free=_freeable(comm))


def serial_lock(comm: Any) -> Any:
    """The lock (reentrant) that runs this rank's calls on the MPI communicator ``comm``
    one at a time."""
    global _SERIAL_KEYVAL
    with _KEYVAL_LOCK:
        if _SERIAL_KEYVAL is None:
            _SERIAL_KEYVAL = _mpilib.mpi().Comm.Create_keyval()
        lock = comm.Get_attr(_SERIAL_KEYVAL)
        if lock is None:
            lock = threading.RLock()
            comm.Set_attr(_SERIAL_KEYVAL, lock)
    return lock


def link_constants(comm: Any, value: tuple[float, float] | None = None) -> Any:
    """The (seconds per message, seconds per byte) measured on the MPI communicator ``comm``
    (None: not yet); ``value``: record it."""
    global _LINK_KEYVAL
    with _KEYVAL_LOCK:
        if _LINK_KEYVAL is None:
            _LINK_KEYVAL = _mpilib.mpi().Comm.Create_keyval()
    if value is not None:
        comm.Set_attr(_LINK_KEYVAL, value)
    return comm.Get_attr(_LINK_KEYVAL)


def apart(comm: Any) -> Any:
    """The duplicate of the MPI communicator ``comm`` that carries sparsecoll's own
    messages, made by ``comm.Dup()`` on first use: collective, so every rank must first ask
    for it at the same call (see :meth:`Communicator.apart`)."""
    global _APART_KEYVAL
    with _KEYVAL_LOCK:
        if _APART_KEYVAL is None:
            _APART_KEYVAL = _mpilib.mpi().Comm.Create_keyval(delete_fn=_apart_deleted)
    dup = comm.Get_attr(_APART_KEYVAL)
    if dup is None:
        dup = comm.Dup()
        comm.Set_attr(_APART_KEYVAL, dup)
    return dup


def _apart_deleted(comm: Any, keyval: int, dup: Any) -> None:
    # MPI has a few thousand context ids: a duplicate lives no longer than its communicator
    if _freeable(comm):
        dup.Free()


def _freeable(comm: Any) -> bool:
    """Whether the duplicates hung on ``comm`` may be freed as its attributes are deleted:
    not COMM_WORLD's and COMM_SELF's, deleted inside MPI_Finalize."""
    MPI = _mpilib.mpi()
    return comm != MPI.COMM_WORLD and comm != MPI.COMM_SELF


def stop_at_finalize() -> None:
    """Complete every engine's pending calls when MPI_Finalize starts (registered once)."""
    with _KEYVAL_LOCK:
        if _FINALIZE_KEYVAL:
            return
        MPI = _mpilib.mpi()
        _FINALIZE_KEYVAL.append(MPI.Comm.Create_keyval(delete_fn=_finalizing))
        MPI.COMM_SELF.Set_attr(_FINALIZE_KEYVAL[0], True)


def _finalizing(comm: Any, keyval: int, value: Any) -> None:
    stop()
