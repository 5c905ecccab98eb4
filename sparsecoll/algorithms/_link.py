"""The speed of a communicator's links, measured once: what ``auto`` charges per message and
per byte sent.

Every rank sends a small and a 1 MiB message to the next rank in a ring while receiving from
the one before, twice. The fastest small exchange is the time per message; the difference of
the fastest times, per byte, the time per byte; each averaged over the ranks (one small
allreduce), the same on every rank. It is kept on the MPI
communicator (every later call on it reuses it; on the communicator object itself where it
has none, as one over a torch process group), clipped to [1e-7, 1e-2] s a message and
[1e-12, 1e-6] s/B (1 TB/s to 1 MB/s). On a node whose ranks share cores the estimates include
their contention, as the calls do.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import numpy as np

from .. import _keyvals
from ..comm import Communicator

__all__ = ["PROBE_BYTES", "link_constants"]

PROBE_BYTES = 1 << 20
_KEPT: weakref.WeakKeyDictionary[Any, tuple[float, float]] = weakref.WeakKeyDictionary()


def link_constants(comm: Communicator) -> tuple[float, float]:
    """The measured ``(seconds per message, seconds per byte)`` of ``comm``'s links
    (collective on first use)."""
    mpi = getattr(comm, "mpi_comm", None)
    known = _KEPT.get(comm) if mpi is None else _keyvals.link_constants(mpi)
    if known is not None:
        return known
    P, r = comm.size, comm.rank
    dest, source = (r + 1) % P, (r - 1) % P
    best: dict[int, float] = {}
    for size in (8, PROBE_BYTES, 8, PROBE_BYTES):
        send, recv = np.zeros(size, np.uint8), np.empty(size, np.uint8)
        start = time.perf_counter()
        comm.sendrecv(send, dest, recv, source)
        best[size] = min(best.get(size, np.inf), time.perf_counter() - start)
    per_byte = max(best[PROBE_BYTES] - best[8], 0.0) / (PROBE_BYTES - 8)
    alpha, beta = (float(v) / P for v in comm.allreduce_floats([best[8], per_byte], "sum"))
    value = (min(max(alpha, 1e-7), 1e-2), min(max(beta, 1e-12), 1e-6))
    if mpi is None:
        _KEPT[comm] = value
        return value
    return _keyvals.link_constants(mpi, value)
