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
order); ranges sent dense drop entries that sum to exactly zero. Rows (``x.width`` = D) travel
as an index and D values a pair, a dense range as its rows: the rule counts D values an index.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._array import index_dtype, nonzero_count, nonzero_positions
from ..comm import Communicator, Request
from ..registry import register_algorithm
from ..sparse import SparseVector
from ._merge import RunStack, accumulate_dtype, add_sparse
from ._wire import WireOption, decode_pairs, encode_pairs, gathered_space, message_space, width
from .base import Algorithm, range_bounds, region_cuts, sparse_is_cheaper

__all__ = ["DSA", "bruck_counts", "chunk_bytes"]

TAG_IDX = 21
TAG_VAL = 22
TAG_AG = 23


def chunk_bytes(nnz: int, length: int, itype: Any, vtype: Any, width: int | None = None) -> int:
    """Bytes a chunk of ``nnz`` pairs in a range of ``length`` costs: sparse or dense
    (``width``: rows of that many values)."""
    vsz = np.dtype(vtype).itemsize * (width or 1)
    if sparse_is_cheaper(nnz, length, itype, vtype, width):
        return nnz * (np.dtype(itype).itemsize + vsz)
    return length * vsz


@register_algorithm
class DSA(WireOption, Algorithm):
    name = "dsa"
    takes_rows = True

    def reduce(self, comm: Communicator, x: SparseVector) -> SparseVector:
        if comm.size == 1:
            out = SparseVector(x.indices.copy(), x.values.copy(), x.n)
            out.info["phases"] = {}
            return out
        bounds = range_bounds(x.n, comm.size)
        with comm.measure() as rs_stats:
            owned = _reduce_scatter(comm, x, bounds, self.compact(x))
        with comm.measure() as ag_stats:
            out = _allgather(comm, owned, x, bounds, self.compact(x))
        out.info["phases"] = {"reduce_scatter": rs_stats, "allgather": ag_stats}
        return out


def _reduce_scatter(comm: Communicator, x: SparseVector, bounds: np.ndarray, compact: bool):
    """Return this rank's reduced range as ("sparse", idx, vals) or ("dense", vals).

    ``compact``: sparse chunks travel as one wire message each, made before the counts are
    exchanged so that their bytes go with them (every receive is posted up front).
    """
    P, r, n = comm.size, comm.rank, x.n
    xp = x.xp
    itype, vtype, row = index_dtype(n), x.dtype, x.row_shape
    acc_t = accumulate_dtype(vtype)
    cut = region_cuts(x.indices, bounds)
    sendcounts = np.diff(cut)
    lengths = np.diff(bounds)
    lo, length = int(bounds[r]), int(lengths[r])

    def is_dense(count: int, ln: int) -> bool:
        return not sparse_is_cheaper(count, ln, itype, vtype, x.width)

    msgs: dict[int, Any] = {}  # (compact: each sparse chunk's message, by destination)
    if compact:
        for dst in range(P):
            a, b = int(cut[dst]), int(cut[dst + 1])
            if dst != r and a < b and not is_dense(b - a, int(lengths[dst])):
                span = bounds[dst], bounds[dst + 1]
                msgs[dst] = encode_pairs(x.indices[a:b], x.values[a:b], *span)
        said = [int(msgs[d].nbytes) if d in msgs else 0 for d in range(P)]
        got = comm.alltoall_ints(np.stack([sendcounts, said], axis=1))
        recvcounts, recvbytes = [c for c, _ in got], [b for _, b in got]
    else:
        recvcounts = comm.alltoall_ints(sendcounts)

    # every receive posted first, in rotated order (from r-1, r-2, ...)
    order: list[int] = []
    chunks: dict[int, tuple[list[Any], list[Request]]] = {}
    coded: set[int] = set()  # (sources whose chunk is a wire message)
    any_dense = is_dense(int(sendcounts[r]), length)
    for s in range(1, P):
        src = (r - s) % P
        c = int(recvcounts[src])
        if c == 0:
            continue
        if is_dense(c, length):
            any_dense = True
            buf = xp.empty((length, *row), vtype)
            chunks[src] = ([buf], [comm.irecv(buf, src, TAG_VAL)])
        elif compact:
            (msg,) = message_space([recvbytes[src]])  # (decoded where it lands)
            chunks[src] = ([msg], [comm.irecv(msg, src, TAG_IDX)])
            coded.add(src)
        else:
            ib, vb = xp.empty(c, itype), xp.empty((c, *row), vtype)
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
            dense = xp.zeros((int(lengths[dst]), *row), vtype)
            dense[x.indices[a:b] - int(bounds[dst])] = x.values[a:b]
            sends.append(comm.isend(dense, dst, TAG_VAL))
        elif compact:
            sends.append(comm.isend(msgs[dst], dst, TAG_IDX))
        else:
            sends.append(comm.isend(x.indices[a:b], dst, TAG_IDX))
            sends.append(comm.isend(x.values[a:b], dst, TAG_VAL))

    mine = (x.indices[cut[r] : cut[r + 1]], x.values[cut[r] : cut[r + 1]])
    if any_dense:
        acc = xp.zeros((length, *row), acc_t)
        add_sparse(acc, mine[0], mine[1], lo)
    else:
        stack = RunStack(n, xp, acc_t, row)
        stack.push(mine[0], mine[1].astype(acc_t, copy=False))
    # Chunks are summed in the order the senders send them, while later ones are in flight:
    # a fixed order makes the sum reproducible. Each request is waited on in turn rather
    # than with Waitany, which is slow on oversubscribed nodes (docs/guide/algorithms.md).
    for src in order:
        parts, reqs = chunks.pop(src)
        Request.waitall(reqs)
        if src in coded:
            parts = list(decode_pairs(parts[0], itype, vtype, lo, lo + length, width(x.values)))
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
            return ("dense", acc.astype(vtype, copy=False))
        nz = nonzero_positions(acc)
        return ("sparse", (nz + lo).astype(itype), acc[nz].astype(vtype, copy=False))
    idx, vals = stack.result()
    vals = vals.astype(vtype, copy=False)
    if is_dense(int(idx.shape[0]), length):
        dense = xp.zeros((length, *row), vtype)
        dense[idx - lo] = vals
        return ("dense", dense)
    return ("sparse", idx, vals)


def bruck_counts(size: int) -> list[int]:
    """Blocks sent in each round of a Bruck allgather over ``size`` ranks (they sum to P−1)."""
    out, dist = [], 1
    while dist < size:
        out.append(min(dist, size - dist))
        dist <<= 1
    return out


def _allgather(
    comm: Communicator, owned, x: SparseVector, bounds: np.ndarray, compact: bool
) -> SparseVector:
    """Bruck-allgather the reduced ranges straight into the result's arrays.

    The owners' nnz go first, so every rank knows each range's form and place. Round i
    (dist = 2^i) sends ranges r, r+1, … (min(dist, P − dist) of them) to r − dist, indices
    and values as separate messages into their final places. ``compact``: a sparse range
    travels as its owner's wire message (its length gathered with the nnz), forwarded as is.
    """
    P, r, n, xp = comm.size, comm.rank, x.n, x.xp
    itype, vtype = index_dtype(n), x.dtype
    lengths = [int(v) for v in np.diff(bounds)]
    count = lengths[r] if owned[0] == "dense" else int(owned[1].shape[0])
    mine = None
    if compact and owned[0] == "sparse":
        mine = encode_pairs(owned[1], owned[2], bounds[r], bounds[r + 1])
    if compact:
        got = comm.allgather_ints([count, 0 if mine is None else mine.shape[0]])
        nnz, msg_bytes = got[:, 0].tolist(), got[:, 1].tolist()
    else:
        nnz, msg_bytes = comm.allgather_ints(count), [0] * P
    dense = [not sparse_is_cheaper(c, ln, itype, vtype, x.width) for c, ln in zip(nnz, lengths)]
    icount = [0 if d or compact else c for d, c in zip(dense, nnz)]
    vcount = [ln if d else 0 if compact else c for d, ln, c in zip(dense, lengths, nnz)]
    ioff = np.concatenate(([0], np.cumsum(icount))).astype(np.int64)
    voff = np.concatenate(([0], np.cumsum(vcount))).astype(np.int64)
    # (each message in its 8-aligned slot, its zeros forwarded with it: decoded where it lies)
    out_b, boff = gathered_space(msg_bytes, r, mine)
    out_i = xp.empty(int(ioff[-1]), itype)
    out_v = xp.empty((int(voff[-1]), *x.row_shape), vtype)
    if owned[0] == "dense":
        out_v[voff[r] : voff[r + 1]] = owned[1]
    elif not compact:
        out_i[ioff[r] : ioff[r + 1]] = owned[1]
        out_v[voff[r] : voff[r + 1]] = owned[2]

    def pieces(first: int, count: int):
        """(array, lo, hi) element intervals of ranges first .. first+count-1 (mod P)."""
        spans = [(first, min(first + count, P))]
        if first + count > P:
            spans.append((0, first + count - P))
        for arr, off in ((out_i, ioff), (out_v, voff), (out_b, boff)):
            for a, b in spans:
                if off[b] > off[a]:
                    yield arr, int(off[a]), int(off[b])

    dist = 1
    for cnt in bruck_counts(P):
        dst, src = (r - dist) % P, (r + dist) % P
        reqs = [comm.irecv(arr[a:b], src, TAG_AG) for arr, a, b in pieces(src, cnt)]
        reqs += [comm.isend(arr[a:b], dst, TAG_AG) for arr, a, b in pieces(r, cnt)]
        Request.waitall(reqs)
        dist <<= 1
    if not any(dense) and not compact:
        return SparseVector(out_i, out_v, n)
    pieces_i, pieces_v = [], []
    for j in range(P):
        seg_v = out_v[voff[j] : voff[j + 1]]
        if dense[j]:
            nz = nonzero_positions(seg_v)
            pieces_i.append((nz + int(bounds[j])).astype(itype))
            pieces_v.append(seg_v[nz])
        elif compact:
            msg = out_b[boff[j] : boff[j] + msg_bytes[j]]
            i, v = decode_pairs(msg, itype, vtype, bounds[j], bounds[j + 1], width(x.values))
            pieces_i.append(i)
            pieces_v.append(v)
        else:
            pieces_i.append(out_i[ioff[j] : ioff[j + 1]])
            pieces_v.append(seg_v)
    return SparseVector(xp.concatenate(pieces_i), xp.concatenate(pieces_v), n)
