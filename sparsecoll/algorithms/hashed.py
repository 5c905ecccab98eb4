"""hashed: balanced hash-partitioned exact sparse allreduce (ZEN's balanced parallelism).

Wang et al., "Zen: Empowering Distributed Training with Sparsity-driven Data
Synchronization", OSDI'25. Indices move in blocks of B = 64, blocks in stripes of P: every
stripe gives one block to every rank, rotated by a hash of the stripe (:mod:`._stripes`), so
any hot region is spread within a block per stripe of even, and an owner's coordinates
ascend with the indices. Push: an alltoall of counts, then each rank sends each owner its
entries (rotated point to point) as coordinates in the owner's range; owners merge the runs
as they arrive. Pull: an allgather of the owners' counts, then a Bruck allgather of their
reduced runs. A run travels as COO offsets or as a bitmap over the range plus values,
whichever is smaller (:mod:`._hashwire`); every rank maps each run back (still sorted) and
interleaves the P disjoint runs. Volume sent by rank r: push Σ_{j≠r} bytes(c_rj, L); pull
Σ_i Σ_{b<cnt_i} bytes(K_{r+b}, L); bytes(m, L) = m·v + min(m·o, ⌈L/8⌉), L = ⌈n/(B·P)⌉·B,
o the offsets' size (int32 while L < 2**31). ``result.info["phases"]`` holds each phase's
CommStats. Exact: every rank gets the same bits, and repeated runs too (fixed summation
order); an owner whose incoming entries reach L/8 sums them densely and drops entries that
sum to exactly zero. With ``wire="compact"`` every run travels as one :mod:`sparsecoll.wire`
message over [0, L) instead (its bytes exchanged with its count): the same bits.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from .. import _state
from .._array import index_dtype, nonzero_positions, stable_argsort
from .._options import integer
from ..comm import Communicator, Request
from ..registry import register_algorithm
from ..sparse import SparseVector
from ._hashwire import decode_run, encode_run, run_bytes
from ._merge import RunStack, accumulate_dtype
from ._stripes import Stripes
from ._wire import WIRES, WireOption, decode_pairs, encode_pairs, gathered_space, message_space
from .allgather import merge_runs
from .base import Algorithm, region_cuts
from .dsa import bruck_counts

__all__ = ["BLOCK_SHIFT", "Hashed"]

TAG_PUSH = 41
TAG_PULL = 42
DENSE_SUM = 8  # an owner sums densely when its incoming entries reach L / DENSE_SUM
BLOCK_SHIFT = 6  # indices move in blocks of 2**BLOCK_SHIFT consecutive ones


@register_algorithm
class Hashed(WireOption, Algorithm):
    """Exact sparse allreduce over owners chosen by a hash of the index blocks.

    Args:
        seed: picks the hash (int >= 0, default 0); the same on every rank.
        wire: ``"raw"`` (runs as COO offsets or a bitmap, whichever is smaller) or
            ``"compact"`` (each run one :mod:`sparsecoll.wire` message, bit-identical
            results; CuPy arrays travel raw).
    """

    name = "hashed"
    takes_rows = True
    state_kinds: ClassVar[dict[str, _state.Kind] | None] = {}  # (seed is the constructor's)
    fixed_options: ClassVar[tuple[str, ...]] = ("seed", "wire")

    def __init__(self, seed: int = 0, wire: str = "raw") -> None:
        WireOption.__init__(self, wire)
        self.seed = integer("seed", seed, 0, int64=True)

    def signature(self) -> list[int]:
        return [self.seed, WIRES.index(self.wire)]

    def reduce(self, comm: Communicator, x: SparseVector) -> SparseVector:
        if comm.size == 1:
            out = SparseVector(x.indices.copy(), x.values.copy(), x.n)
            out.info["phases"] = {}
            return out
        plan = _Plan(Stripes(x.n, comm.size, BLOCK_SHIFT, self.seed), x.dtype, x.row_shape)
        plan.compact = self.compact(x)
        with comm.measure() as push_stats:
            owned = _push(comm, x, plan)
        with comm.measure() as pull_stats:
            out = _pull(comm, owned, x, plan)
        out.info["phases"] = {"push": push_stats, "pull": pull_stats}
        return out


class _Plan:
    """The owners' map, their range length and the offset and value types of their runs."""

    __slots__ = ("compact", "length", "otype", "row", "stripes", "vtype")

    def __init__(self, stripes: Stripes, vtype: Any, row: tuple[int, ...] = ()) -> None:
        self.stripes = stripes
        self.length = stripes.length
        self.otype = index_dtype(self.length)
        self.vtype = np.dtype(vtype)
        self.row = row  # an entry's values: () or (D,) for rows
        self.compact = False  # runs as wire messages

    def run_bytes(self, m: int) -> int:
        return run_bytes(m, self.length, self.otype, self.vtype, self.row[0] if self.row else 1)

    def decode(self, piece: Any, m: int) -> tuple[Any, Any]:
        if self.compact:
            width = self.row[0] if self.row else None
            return decode_pairs(piece, self.otype, self.vtype, 0, self.length, width)
        return decode_run(piece, m, self.length, self.otype, self.vtype, self.row)

    def encode(self, offsets: Any, values: Any) -> Any:
        """A run's wire message (compact; the raw ones are written in place)."""
        return encode_pairs(offsets, values, 0, self.length)

    def empty(self, xp: Any) -> tuple[Any, Any]:
        return xp.zeros(0, self.otype), xp.zeros((0, *self.row), self.vtype)


def _push(comm: Communicator, x: SparseVector, plan: _Plan):
    """Send every entry to its owner; return this rank's reduced run (offsets, values)."""
    P, r, xp = comm.size, comm.rank, x.xp
    owner, coords = plan.stripes.locate(x.indices)
    order = stable_argsort(owner, P)  # (stable: each owner's coordinates stay ascending)
    coords, vals = coords[order].astype(plan.otype), x.values[order]
    cut = region_cuts(owner[order], np.arange(P + 1, dtype=np.int64))
    sendcounts = np.diff(cut)
    dests = [(r + s) % P for s in range(1, P) if sendcounts[(r + s) % P]]
    length = plan.length
    if plan.compact:  # (each run's message made first: its bytes go with its count)
        part = {d: slice(int(cut[d]), int(cut[d + 1])) for d in dests}
        msgs = {d: plan.encode(coords[part[d]], vals[part[d]]) for d in dests}
        said = [int(msgs[d].nbytes) if d in msgs else 0 for d in range(P)]
        got = comm.alltoall_ints(np.stack([sendcounts, said], axis=1))
        recvcounts, bytes_in = [c for c, _ in got], [b for _, b in got]
    else:
        recvcounts = comm.alltoall_ints(sendcounts)

    # every receive posted first, in rotated order (from r-1, r-2, ...), into one buffer
    order_in = [(r - s) % P for s in range(1, P) if recvcounts[(r - s) % P]]
    if plan.compact:
        sizes_in = [bytes_in[src] for src in order_in]
    else:
        sizes_in = [plan.run_bytes(int(recvcounts[src])) for src in order_in]
    if plan.compact:  # (each message 8-aligned: decoded where it lands)
        parts_in = message_space(sizes_in)
    else:
        starts_in = np.concatenate(([0], np.cumsum(sizes_in, dtype=np.int64))).tolist()
        inbuf = xp.empty(int(starts_in[-1]), np.uint8)
        parts_in = [inbuf[starts_in[q] : starts_in[q + 1]] for q in range(len(order_in))]
    reqs = [comm.irecv(parts_in[q], src, TAG_PUSH) for q, src in enumerate(order_in)]
    # then every send, rotated (to r+1, r+2, ...), each run encoded just before it goes
    sends: list[Request] = []
    if plan.compact:
        sends = [comm.isend(msgs[dst], dst, TAG_PUSH) for dst in dests]
        dests = []
    sizes_out = [plan.run_bytes(int(sendcounts[dst])) for dst in dests]
    starts_out = np.concatenate(([0], np.cumsum(sizes_out, dtype=np.int64))).tolist()
    outbuf = xp.empty(int(starts_out[-1]), np.uint8)
    for q, dst in enumerate(dests):
        a, b = int(cut[dst]), int(cut[dst + 1])
        piece = outbuf[starts_out[q] : starts_out[q + 1]]
        encode_run(coords[a:b], vals[a:b], length, piece)
        sends.append(comm.isend(piece, dst, TAG_PUSH))

    acc_t = accumulate_dtype(plan.vtype)
    mine = (coords[cut[r] : cut[r + 1]], vals[cut[r] : cut[r + 1]])
    dense = sum(int(c) for c in recvcounts) * DENSE_SUM >= length
    if dense:
        acc = xp.zeros((length, *plan.row), acc_t)
        acc[mine[0]] += mine[1]  # (offsets in a run are unique: each added once)
    else:
        stack = RunStack(length, xp, acc_t, plan.row)
        stack.push(mine[0], mine[1].astype(acc_t, copy=False))
    # runs are summed in the senders' rotated order while later ones are in flight: a
    # fixed order makes the sum reproducible
    for q, src in enumerate(order_in):
        reqs[q].wait()
        offsets, values = plan.decode(parts_in[q], int(recvcounts[src]))
        if dense:
            acc[offsets] += values
        else:
            stack.push(offsets, values.astype(acc_t, copy=False))
    Request.waitall(sends)

    if dense:
        nz = nonzero_positions(acc)
        return nz.astype(plan.otype), acc[nz].astype(plan.vtype)
    if not stack.runs:
        return plan.empty(xp)
    offsets, values = stack.result()
    return offsets, values.astype(plan.vtype, copy=False)


def _pull(comm: Communicator, owned, x: SparseVector, plan: _Plan):
    """Bruck-allgather the owners' runs into one byte buffer, then decode every run.

    Every rank, the owner included, decodes the same bytes and merges them the same way.
    """
    P, r, n, xp = comm.size, comm.rank, x.n, x.xp
    m = int(owned[0].shape[0])
    if plan.compact:  # (the message made first: its bytes are gathered with the counts)
        msg = plan.encode(*owned) if m else np.zeros(0, np.uint8)
        got = comm.allgather_ints([m, int(msg.nbytes)])
        counts, sizes = got[:, 0].tolist(), got[:, 1].tolist()
    else:
        counts = [int(c) for c in comm.allgather_ints(m)]
        sizes = [plan.run_bytes(c) for c in counts]
    if plan.compact:  # (each message in its 8-aligned slot, its zeros forwarded with it)
        buf, starts = gathered_space(sizes, r, msg)
    else:
        starts = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64))).tolist()
        buf = xp.empty(int(starts[-1]), np.uint8)
        encode_run(owned[0], owned[1], plan.length, buf[starts[r] : starts[r + 1]])

    def pieces(first: int, count: int):
        """(lo, hi) byte intervals of runs first .. first+count-1 (mod P)."""
        spans = [(first, min(first + count, P))]
        if first + count > P:
            spans.append((0, first + count - P))
        return [(starts[a], starts[b]) for a, b in spans if starts[b] > starts[a]]

    dist = 1
    for cnt in bruck_counts(P):
        dst, src = (r - dist) % P, (r + dist) % P
        reqs = [comm.irecv(buf[a:b], src, TAG_PULL) for a, b in pieces(src, cnt)]
        reqs += [comm.isend(buf[a:b], dst, TAG_PULL) for a, b in pieces(r, cnt)]
        Request.waitall(reqs)
        dist <<= 1

    itype = index_dtype(n)
    runs = []
    for j in range(P):
        if counts[j]:
            piece = buf[starts[j] : starts[j] + sizes[j]]
            runs.append(plan.decode(piece, counts[j]))
        else:
            runs.append(plan.empty(xp))
    if not sum(counts):
        return SparseVector.empty(n, plan.vtype, xp, x.width)
    walked = plan.stripes.gather([off for off, _ in runs])
    if walked is not None:
        idx, order = walked
        return SparseVector(idx.astype(itype), xp.concatenate([v for _, v in runs])[order], n)
    # (on a device) the runs map back sorted and are disjoint: merging only interleaves them
    back = [(plan.stripes.indices(off, j).astype(itype), v) for j, (off, v) in enumerate(runs)]
    return SparseVector(*merge_runs([r for r in back if r[0].shape[0]], n), n)
