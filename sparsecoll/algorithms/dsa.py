"""dsa (TopkDSA): SparCML's split-allgather sparse allreduce with the dynamic dense switch.

Renggli et al., SC'19 (``SSAR_Split_allgather``/DSAR); "TopkDSA" in Li & Hoefler, PPoPP'22.

[0, n) is split into P near-equal ranges, rank j owning range j. Sparse reduce-scatter:
after an alltoall of counts, each rank sends its pairs in range j to rank j (rotated: step s
sends to r+s) and the owner merges each chunk as it arrives. Allgather of the reduced ranges
by Bruck's algorithm (⌈log2 P⌉ rounds, after an allgather of their nnz). A chunk or range
travels as pairs while nnz·(index + value bytes) < length·value bytes, dense otherwise.
Volume sent per rank: ≈ k(P−1)/P pairs in the reduce-scatter (spread-out indices), then
(P−1)/P of the reduced vector: from k(P−1)/P pairs (identical indices) to
min(kP·pair, n·v)·(P−1)/P bytes (disjoint). ``result.info["phases"]`` holds each phase's
CommStats. Exact: every rank gets the same bits, and repeated runs too (fixed summation
order); ranges sent dense drop entries that sum to exactly zero.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._array import index_dtype, nonzero_count, nonzero_positions
from ..comm import Communicator, Request
from ..registry import register_algorithm
from ..sparse import SparseVector
from ._merge import accumulate_dtype, add_sparse, merge_two
from .base import Algorithm, RangeLayout, range_bounds, region_cuts, sparse_is_cheaper

__all__ = ["DSA", "bruck_counts", "chunk_bytes"]

TAG_IDX = 21
TAG_VAL = 22
TAG_AG = 23


def chunk_bytes(nnz: int, length: int, itype: Any, vtype: Any) -> int:
    """Bytes a chunk of ``nnz`` pairs in a range of ``length`` costs: sparse or dense."""
    if sparse_is_cheaper(nnz, length, itype, vtype):
        return nnz * (np.dtype(itype).itemsize + np.dtype(vtype).itemsize)
    return length * np.dtype(vtype).itemsize


@register_algorithm
class DSA(Algorithm):
    name = "dsa"

    def reduce(self, comm: Communicator, x: SparseVector) -> SparseVector:
        if comm.size == 1:
            out = SparseVector(x.indices.copy(), x.values.copy(), x.n)
            out.info["phases"] = {}
            return out
        bounds = range_bounds(x.n, comm.size)
        with comm.measure() as rs_stats:
            owned = _reduce_scatter(comm, x, bounds)
        with comm.measure() as ag_stats:
            out = _allgather(comm, owned, x, bounds)
        out.info["phases"] = {"reduce_scatter": rs_stats, "allgather": ag_stats}
        return out


def _reduce_scatter(comm: Communicator, x: SparseVector, bounds: np.ndarray):
    """Return this rank's reduced range as (indices, values) or (None, dense values)."""
    P, r, n = comm.size, comm.rank, x.n
    xp = x.xp
    itype, vtype = index_dtype(n), x.dtype
    acc_t = accumulate_dtype(vtype)
    cut = region_cuts(x.indices, bounds)
    sendcounts = np.diff(cut)
    recvcounts = comm.alltoall_ints(sendcounts)
    lengths = np.diff(bounds)
    lo, length = int(bounds[r]), int(lengths[r])

    def is_dense(count: int, ln: int) -> bool:
        return not sparse_is_cheaper(count, ln, itype, vtype)

    # every receive posted first, in rotated order (from r-1, r-2, ...)
    order: list[int] = []
    chunks: dict[int, tuple[list[Any], list[Request]]] = {}
    any_dense = is_dense(int(sendcounts[r]), length)
    for s in range(1, P):
        src = (r - s) % P
        c = int(recvcounts[src])
        if c == 0:
            continue
        if is_dense(c, length):
            any_dense = True
            buf = xp.empty(length, vtype)
            chunks[src] = ([buf], [comm.irecv(buf, src, TAG_VAL)])
        else:
            ib, vb = xp.empty(c, itype), xp.empty(c, vtype)
            chunks[src] = ([ib, vb], [comm.irecv(ib, src, TAG_IDX), comm.irecv(vb, src, TAG_VAL)])
        order.append(src)
    # then every send, rotated (to r+1, r+2, ...): no rank is everyone's first target
    sends: list[Request] = []
    for s in range(1, P):
        dst = (r + s) % P
        a, b = int(cut[dst]), int(cut[dst + 1])
        if a == b:
            continue
        if is_dense(b - a, int(lengths[dst])):
            dense = xp.zeros(int(lengths[dst]), vtype)
            dense[x.indices[a:b] - int(bounds[dst])] = x.values[a:b]
            sends.append(comm.isend(dense, dst, TAG_VAL))
        else:
            sends.append(comm.isend(x.indices[a:b], dst, TAG_IDX))
            sends.append(comm.isend(x.values[a:b], dst, TAG_VAL))

    mine = (x.indices[cut[r] : cut[r + 1]], x.values[cut[r] : cut[r + 1]])
    if any_dense:
        acc = xp.zeros(length, acc_t)
        add_sparse(acc, mine[0], mine[1], lo)
    else:
        stack = _RunStack(n, xp, acc_t)
        stack.push(mine[0], mine[1].astype(acc_t, copy=False))
    # Chunks are summed in the order the senders send them, while later ones are in flight:
    # a fixed order makes the sum reproducible. Each request is waited on in turn rather
    # than with Waitany, which is slow on oversubscribed nodes (docs/guide/algorithms.md).
    for src in order:
        parts, reqs = chunks.pop(src)
        Request.waitall(reqs)
        if any_dense:
            if len(parts) == 1:
                acc += parts[0]
            else:
                add_sparse(acc, parts[0], parts[1], lo)
        else:
            stack.push(parts[0], parts[1].astype(acc_t, copy=False))
    Request.waitall(sends)

    if any_dense:
        nnz = nonzero_count(acc)
        if is_dense(nnz, length):
            return None, acc.astype(vtype, copy=False)
        nz = nonzero_positions(acc)
        return (nz + lo).astype(itype), acc[nz].astype(vtype, copy=False)
    idx, vals = stack.result()
    vals = vals.astype(vtype, copy=False)
    if is_dense(int(idx.shape[0]), length):
        dense = xp.zeros(length, vtype)
        dense[idx - lo] = vals
        return None, dense
    return idx, vals


class _RunStack:
    """Merge runs as they arrive, binary-counter style: O(m log runs) work, mostly overlapped.

    A run merges with the top of the stack while the top is at most twice its size.
    """

    def __init__(self, n: int, xp: Any, dtype: Any) -> None:
        self.n, self.xp, self.dtype = n, xp, dtype
        self.runs: list[tuple[Any, Any]] = []

    def push(self, idx: Any, vals: Any) -> None:
        if idx.shape[0] == 0:
            return
        run = (idx, vals)
        while self.runs and self.runs[-1][0].shape[0] <= 2 * run[0].shape[0]:
            top = self.runs.pop()
            run = merge_two(top[0], top[1], run[0], run[1], self.n)
        self.runs.append(run)

    def result(self) -> tuple[Any, Any]:
        if not self.runs:
            return self.xp.zeros(0, index_dtype(self.n)), self.xp.zeros(0, self.dtype)
        run = self.runs.pop()
        while self.runs:
            top = self.runs.pop()
            run = merge_two(top[0], top[1], run[0], run[1], self.n)
        return run


def bruck_counts(size: int) -> list[int]:
    """Blocks sent in each round of a Bruck allgather over ``size`` ranks (they sum to P−1)."""
    out, dist = [], 1
    while dist < size:
        out.append(min(dist, size - dist))
        dist <<= 1
    return out


def _allgather(comm: Communicator, owned, x: SparseVector, bounds: np.ndarray) -> SparseVector:
    """Bruck-allgather the reduced ranges straight into the result's arrays.

    The owners' nnz go first, so every rank knows each range's form and place. Round i
    (dist = 2^i) sends ranges r, r+1, … (min(dist, P − dist) of them) to r − dist, indices
    and values as separate messages into their final places.
    """
    P, r = comm.size, comm.rank
    count = int(bounds[r + 1] - bounds[r]) if owned[0] is None else int(owned[0].shape[0])
    layout = RangeLayout(comm.allgather_ints(count), bounds, x.n, x.dtype, x.xp)
    layout.put(r, owned)
    dist = 1
    for cnt in bruck_counts(P):
        dst, src = (r - dist) % P, (r + dist) % P
        reqs = [comm.irecv(arr[a:b], src, TAG_AG) for arr, a, b in layout.pieces(src, cnt)]
        reqs += [comm.isend(arr[a:b], dst, TAG_AG) for arr, a, b in layout.pieces(r, cnt)]
        Request.waitall(reqs)
        dist <<= 1
    return layout.result()
