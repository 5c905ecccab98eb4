"""ring: SparCML's sparse ring allreduce (a reduce-scatter ring, then an allgather ring).

Renggli et al., "SparCML: High-Performance Sparse Communication for Machine Learning", SC'19.

[0, n) is split into P near-equal segments, each cut into C = :func:`ring_blocks` near-equal
blocks (a block is one message). Reduce-scatter, P−1 steps: at step s rank r sends its running
sum of segment (r − s) mod P to r+1 and receives segment (r − s − 1) mod P from r−1, adding
its own entries to it block by block (with C > 1 a block's merge overlaps the next block's
transfer); rank r ends with segment (r + 1) mod P reduced. Allgather, P−1 steps: each rank
forwards to r+1 the reduced segment it got last (its own first), into receives posted up
front in the result's arrays. A block travels as pairs while nnz·(index + value bytes) <
length·value bytes, as its dense values otherwise; sizes go first (metadata), so no receive
probes. Volume sent per rank: the running sums, from k/P pairs (step 0) to a segment's
union over P−1 ranks (last step) — k(P−1)/P pairs in all for identical indices, ≈ k(P−1)/2
for spread-out ones — then P−1 reduced segments, (P−1)/P of the result.
``result.info["phases"]`` holds each phase's CommStats. Exact: each segment is summed by one
chain of ranks in a fixed order and forwarded unchanged, so every rank gets the same bits,
every run; blocks that went dense drop entries that sum to exactly zero.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._array import aligned_view, index_dtype, nonzero_count, nonzero_positions
from ..comm import Communicator, Request
from ..registry import register_algorithm
from ..sparse import SparseVector
from ._merge import accumulate_dtype, add_sparse, merge_two
from .base import (
    Algorithm,
    RangeLayout,
    pack_pairs,
    range_bounds,
    region_cuts,
    sparse_is_cheaper,
    unpack_pairs,
)

__all__ = ["Ring", "ring_blocks"]

TAG_RS = 51
TAG_SIZE = 52
TAG_AG = 53

Run = tuple[Any, Any]  # (indices, values) sorted unique; (None, dense values) past break-even


def ring_blocks(n: int, size: int) -> int:
    """Blocks per segment, the same on every rank: 1.

    More blocks let one block's merge overlap the next one's transfer, at a message and a
    size exchange each per step; on one shared-memory node they measured slower.
    """
    return 1


@register_algorithm
class Ring(Algorithm):
    name = "ring"

    def reduce(self, comm: Communicator, x: SparseVector) -> SparseVector:
        if comm.size == 1:
            out = SparseVector(x.indices.copy(), x.values.copy(), x.n)
            out.info["phases"] = {}
            return out
        blocks = _Blocks(x, comm.size, ring_blocks(x.n, comm.size))
        with comm.measure() as rs_stats:
            owned = _reduce_scatter(comm, blocks)
        with comm.measure() as ag_stats:
            out = _allgather(comm, blocks, owned)
        out.info["phases"] = {"reduce_scatter": rs_stats, "allgather": ag_stats}
        return out


class _Blocks:
    """Block ``j·C + c`` of [0, n): block c of segment j; this rank's entries of each."""

    def __init__(self, x: SparseVector, size: int, chunks: int) -> None:
        self.x, self.size, self.chunks, self.xp = x, size, chunks, x.xp
        self.itype, self.vtype = index_dtype(x.n), np.dtype(x.dtype)
        # running sums travel in the accumulation type (float64 for float16): the sum is
        # rounded to the values' dtype once, at its owner, as the other exact algorithms do
        self.wtype = accumulate_dtype(self.vtype)
        self.bounds = [int(b) for b in range_bounds(x.n, size * chunks)]
        self.cuts = region_cuts(x.indices, np.asarray(self.bounds, np.int64))

    def span(self, j: int, c: int) -> tuple[int, int]:
        """(first index, length) of block c of segment j."""
        b = j * self.chunks + c
        return self.bounds[b], self.bounds[b + 1] - self.bounds[b]

    def own(self, j: int, c: int) -> Run:
        b = j * self.chunks + c
        a, e = self.cuts[b], self.cuts[b + 1]
        return self.x.indices[a:e], self.x.values[a:e].astype(self.wtype, copy=False)

    def start(self, j: int, c: int) -> Run:
        """This rank's entries of the block, in the form they travel."""
        return self._form(*self.own(j, c), j, c)

    def add_own(self, run: Run, j: int, c: int) -> Run:
        """``run`` (a received running sum, this rank's to change) plus this rank's entries."""
        idx, vals = run
        own_i, own_v = self.own(j, c)
        if idx is None:  # past break-even: the union only grows, so it stays dense
            add_sparse(vals, own_i, own_v, self.span(j, c)[0])
            return run
        return self._form(*merge_two(idx, vals, own_i, own_v, self.x.n), j, c)

    def _form(self, idx: Any, vals: Any, j: int, c: int, dtype: Any = None) -> Run:
        """The run as pairs or dense, by the break-even rule for ``dtype`` (the running
        sums' type by default)."""
        dtype = self.wtype if dtype is None else dtype
        lo, length = self.span(j, c)
        if sparse_is_cheaper(int(idx.shape[0]), length, self.itype, dtype):
            return idx, vals
        dense = self.xp.zeros(length, dtype)
        dense[idx - lo] = vals
        return None, dense

    def reduced(self, run: Run, j: int, c: int) -> Run:
        """The block's reduced sum, as pairs where its nonzeros are past break-even no more."""
        idx, vals = run
        vals = vals.astype(self.vtype, copy=False)  # (rounded once, here)
        if idx is not None:
            return self._form(idx, vals, j, c, self.vtype)
        if sparse_is_cheaper(nonzero_count(vals), self.span(j, c)[1], self.itype, self.vtype):
            nz = nonzero_positions(vals)
            return (nz + self.span(j, c)[0]).astype(self.itype), vals[nz]
        return None, vals

    # -- the wire form of a block: the one place runs become bytes and back --------------
    def encode(self, run: Run) -> Any:
        idx, vals = run
        return vals.view(np.uint8) if idx is None else pack_pairs(idx, vals)

    def decode(self, buf: Any, j: int, c: int) -> Run:
        """A block's message: its dense size means dense values (pairs are always shorter)."""
        if buf.shape[0] == self.span(j, c)[1] * self.wtype.itemsize:
            return None, aligned_view(buf, self.wtype)
        return unpack_pairs(buf, self.itype, self.wtype)


def _reduce_scatter(comm: Communicator, blocks: _Blocks) -> list[Run]:
    """Run the reduce-scatter ring; return segment r+1's reduced blocks."""
    P, r, C, xp = comm.size, comm.rank, blocks.chunks, blocks.xp
    right, left = (r + 1) % P, (r - 1) % P
    sends: list[Request] = []

    def exchange(run: Run) -> tuple[Any, Request | None]:
        # the receive is posted before the send: both links of a rank busy at once
        buf = blocks.encode(run)
        size = comm.sendrecv_ints(int(buf.nbytes), right, left, TAG_SIZE)
        got = xp.empty(size, np.uint8)
        req = comm.irecv(got, left, TAG_RS) if size else None
        if buf.nbytes:
            sends.append(comm.isend(buf, right, TAG_RS))
        return got, req

    def arrived(c: int, j: int) -> Run:
        got, req = incoming[c]
        if req is not None:
            req.wait()
        return blocks.add_own(blocks.decode(got, j, c), j, c)

    incoming = [exchange(blocks.start(r, c)) for c in range(C)]
    for s in range(1, P - 1):
        j = (r - s) % P  # received at step s − 1, sent on now
        for c in range(C):
            incoming[c] = exchange(arrived(c, j))
    j = (r + 1) % P
    owned = [blocks.reduced(arrived(c, j), j, c) for c in range(C)]
    Request.waitall(sends)
    return owned


def _allgather(comm: Communicator, blocks: _Blocks, owned: list[Run]) -> SparseVector:
    """Run the allgather ring straight into the result's arrays (after their sizes)."""
    P, r, C = comm.size, comm.rank, blocks.chunks
    right, left = (r + 1) % P, (r - 1) % P
    mine = (r + 1) % P
    sizes = [
        blocks.span(mine, c)[1] if idx is None else int(idx.shape[0])
        for c, (idx, _) in enumerate(owned)
    ]
    # row q of the gathered sizes is segment q + 1's
    counts = np.roll(comm.allgather_ints(sizes), 1, axis=0).ravel()
    layout = RangeLayout(counts, np.asarray(blocks.bounds), blocks.x.n, blocks.vtype, blocks.xp)
    for c, run in enumerate(owned):
        layout.put(mine * C + c, run)
    recvs = []  # step s brings segment r − s
    for s in range(P - 1):
        for c in range(C):
            b = ((r - s) % P) * C + c
            recvs.append([comm.irecv(arr[a:e], left, TAG_AG) for arr, a, e in layout.pieces(b, 1)])
    sends = [
        comm.isend(arr[a:e], right, TAG_AG)
        for c in range(C)
        for arr, a, e in layout.pieces(mine * C + c, 1)
    ]
    for s in range(1, P - 1):  # step s forwards what step s − 1 brought
        for c in range(C):
            b = ((r + 1 - s) % P) * C + c
            Request.waitall(recvs[(s - 1) * C + c])
            sends += [comm.isend(arr[a:e], right, TAG_AG) for arr, a, e in layout.pieces(b, 1)]
    Request.waitall([q for reqs in recvs for q in reqs] + sends)
    return layout.result()
