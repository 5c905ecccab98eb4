"""Payloads past MPI-3's int counts (:data:`~._mpilib.COUNT_MAX`) on an MPI library
without the MPI-4 large-count calls: what a Communicator's collectives do instead there.

Each function takes the Communicator (``rank``, ``size``, ``poll``, ``_complete``,
``_wire``, ``allreduce_ints``) and byte views; the same on every rank, as the counts are.
"""

from __future__ import annotations

from typing import Any

from . import _mpilib
from ._buffers import free_type, message
from ._polling import Request

__all__ = ["PAIRS_TAG", "allgatherv_by_bcast", "alltoallv_by_pairs", "alltoallv_past_limit"]

PAIRS_TAG = 0x5A7  # tag of alltoallv_by_pairs' point-to-point messages


def allgatherv_by_bcast(
    comm: Any, send: Any, recv: Any, bcounts: list[int], displs: list[int]
) -> None:
    """Allgatherv of the byte views: every rank's part broadcast from that rank, in pieces
    of at most COUNT_MAX bytes, each landing where it belongs (a broadcast takes no
    displacement)."""
    MPI = _mpilib.mpi()
    me, limit = comm.rank, _mpilib.COUNT_MAX
    recv[displs[me] : displs[me] + bcounts[me]] = send
    for root in range(comm.size):
        end = displs[root] + bcounts[root]
        for start in range(displs[root], end, limit):
            piece = recv[start : min(start + limit, end)]
            comm._complete("Bcast", [piece, MPI.BYTE], root)


def alltoallv_past_limit(comm: Any, *byte_lists: list[int]) -> bool:
    """Whether any rank's alltoallv has a count or displacement past COUNT_MAX bytes on a
    library without large counts (one more small allreduce, metadata, there only: a rank's
    receive offsets depend on what the others send)."""
    if _mpilib.large_counts() or comm.size == 1:
        return False
    mine = max(max(b) for b in byte_lists)
    return int(comm.allreduce_ints([mine], op="max")[0]) > _mpilib.COUNT_MAX


def alltoallv_by_pairs(
    comm: Any, send: Any, recv: Any, sb: list[int], sd: list[int], rb: list[int], rd: list[int]
) -> None:
    """Alltoallv of the byte views: one nonblocking receive from and send to every other
    rank with a part for it (each message split as :func:`~._buffers.message` does),
    completed together; this rank's own part is copied."""
    me, size = comm.rank, comm.size
    recv[rd[me] : rd[me] + rb[me]] = send[sd[me] : sd[me] + sb[me]]
    reqs = []
    for shift in range(1, size):
        src, dst = (me - shift) % size, (me + shift) % size
        for call, view, peer in (
            ("Irecv", recv[rd[src] : rd[src] + rb[src]], src),
            ("Isend", send[sd[dst] : sd[dst] + sb[dst]], dst),
        ):
            if view.shape[0]:
                msg, dtype = message(view)
                req = getattr(comm._wire(), call)(msg, peer, PAIRS_TAG)
                reqs.append(Request(req, poll=comm.poll))
                free_type(dtype)
    Request.waitall(reqs)
