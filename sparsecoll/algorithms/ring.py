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
With ``wire="compact"`` a block's pairs travel as one :mod:`sparsecoll.wire` message (its
size says whether it is one), and a reduced block's message is made once, by its owner, and
forwarded as it came (its size gathered with the nnz); dense blocks travel raw.
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
from ._wire import WireOption, decode_pairs, encode_pairs, message_space
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
class Ring(WireOption, Algorithm):
    name = "ring"

    def reduce(self, comm: Communicator, x: SparseVector) -> SparseVector:
        if comm.size == 1:
            out = SparseVector(x.indices.copy(), x.values.copy(), x.n)
            out.info["phases"] = {}
            return out
        blocks = _Blocks(x, comm.size, ring_blocks(x.n, comm.size), self.compact(x))
        with comm.measure() as rs_stats:
            owned = _reduce_scatter(comm, blocks)
        with comm.measure() as ag_stats:
            out = _allgather(comm, blocks, owned)
        out.info["phases"] = {"reduce_scatter": rs_stats, "allgather": ag_stats}
        return out


class _Blocks:
    """Block ``j·C + c`` of [0, n): block c of segment j; this rank's entries of each."""

    def __init__(self, x: SparseVector, size: int, chunks: int, compact: bool = False) -> None:
        self.x, self.size, self.chunks, self.xp = x, size, chunks, x.xp
        self.compact = compact  # (pairs as wire messages)
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
    def encode(self, run: Run, j: int, c: int) -> tuple[Any, int]:
        """A block's message and the size that announces it: its bytes, or with the compact
        wire twice them plus 1 for dense values."""
        idx, vals = run
        if idx is None:
            buf = vals.view(np.uint8)
            return buf, 2 * int(buf.nbytes) + 1 if self.compact else int(buf.nbytes)
        if self.compact:
            lo, length = self.span(j, c)
            buf = encode_pairs(idx, vals, lo, lo + length)
            return buf, 2 * int(buf.nbytes)
        buf = pack_pairs(idx, vals)
        return buf, int(buf.nbytes)

    def decode(self, buf: Any, size: int, j: int, c: int, dtype: Any = None) -> Run:
        """A block's message (``size``: as :meth:`encode` announced it); raw, its dense size
        means dense values (pairs are always shorter). ``dtype``: the running sums' type
        by default."""
        dtype = self.wtype if dtype is None else np.dtype(dtype)
        if self.compact:
            if size & 1:
                return None, aligned_view(buf, dtype)
            lo, length = self.span(j, c)
            return decode_pairs(buf, self.itype, dtype, lo, lo + length)
        if buf.shape[0] == self.span(j, c)[1] * dtype.itemsize:
            return None, aligned_view(buf, dtype)
        return unpack_pairs(buf, self.itype, dtype)


def _reduce_scatter(comm: Communicator, blocks: _Blocks) -> list[Run]:
    """Run the reduce-scatter ring; return segment r+1's reduced blocks."""
    P, r, C, xp = comm.size, comm.rank, blocks.chunks, blocks.xp
    right, left = (r + 1) % P, (r - 1) % P
    sends: list[Request] = []

    def exchange(run: Run, j: int, c: int) -> tuple[Any, int, Request | None]:
        # the receive is posted before the send: both links of a rank busy at once
        buf, said = blocks.encode(run, j, c)
        size = comm.sendrecv_ints(said, right, left, TAG_SIZE)
        got = message_space([size // 2])[0] if blocks.compact else xp.empty(size, np.uint8)
        req = comm.irecv(got, left, TAG_RS) if got.shape[0] else None
        if buf.nbytes:
            sends.append(comm.isend(buf, right, TAG_RS))
        return got, size, req

    def arrived(c: int, j: int) -> Run:
        got, size, req = incoming[c]
        if req is not None:
            req.wait()
        return blocks.add_own(blocks.decode(got, size, j, c), j, c)

    incoming = [exchange(blocks.start(r, c), r, c) for c in range(C)]
    for s in range(1, P - 1):
        j = (r - s) % P  # received at step s − 1, sent on now
        for c in range(C):
            incoming[c] = exchange(arrived(c, j), j, c)
    j = (r + 1) % P
    owned = [blocks.reduced(arrived(c, j), j, c) for c in range(C)]
    Request.waitall(sends)
    return owned


def _allgather(comm: Communicator, blocks: _Blocks, owned: list[Run]) -> SparseVector:
    """Run the allgather ring straight into the result's arrays (after their sizes); with
    the compact wire, sparse blocks as their owner's messages, decoded into place."""
    P, r, C = comm.size, comm.rank, blocks.chunks
    right, left = (r + 1) % P, (r - 1) % P
    mine = (r + 1) % P
    sizes = [
        blocks.span(mine, c)[1] if idx is None else int(idx.shape[0])
        for c, (idx, _) in enumerate(owned)
    ]
    coded = [
        blocks.encode(run, mine, c)[0] if blocks.compact and run[0] is not None else None
        for c, run in enumerate(owned)
    ]
    said = [0 if m is None else int(m.nbytes) for m in coded] if blocks.compact else []
    # row q of the gathered sizes is segment q + 1's
    gathered = np.roll(comm.allgather_ints(sizes + said), 1, axis=0)
    counts = gathered[:, :C].ravel()
    nbytes = gathered[:, C:].ravel().tolist() if blocks.compact else [0] * (P * C)
    layout = RangeLayout(counts, np.asarray(blocks.bounds), blocks.x.n, blocks.vtype, blocks.xp)
    for c, run in enumerate(owned):
        layout.put(mine * C + c, run)

    def post(b: int) -> tuple[list[Request], Any]:
        if nbytes[b]:  # (a wire message, decoded when it came)
            (buf,) = message_space([nbytes[b]])
            return [comm.irecv(buf, left, TAG_AG)], buf
        return [comm.irecv(arr[a:e], left, TAG_AG) for arr, a, e in layout.pieces(b, 1)], None

    def forward(b: int, buf: Any) -> list[Request]:
        if buf is not None:
            return [comm.isend(buf, right, TAG_AG)]
        return [comm.isend(arr[a:e], right, TAG_AG) for arr, a, e in layout.pieces(b, 1)]

    def place(b: int, reqs: list[Request], buf: Any) -> None:
        Request.waitall(reqs)
        if buf is not None:
            j, c = divmod(b, C)
            layout.put(b, blocks.decode(buf, 0, j, c, blocks.vtype))

    # step s brings segment r − s
    blocks_at = [((r - s) % P) * C + c for s in range(P - 1) for c in range(C)]
    recvs = [post(b) for b in blocks_at]
    sends = [q for c in range(C) for q in forward(mine * C + c, coded[c])]
    for s in range(1, P - 1):  # step s forwards what step s − 1 brought
        for c in range(C):
            at = (s - 1) * C + c
            place(blocks_at[at], *recvs[at])
            sends += forward(blocks_at[at], recvs[at][1])
    for at in range((P - 2) * C, (P - 1) * C):
        place(blocks_at[at], *recvs[at])
    Request.waitall(sends)
    return layout.result()
