"""recursive_doubling: SparCML's SSAR_Recursive_double, sparse with the dynamic dense switch.

Renggli et al., "SparCML: High-Performance Sparse Communication for Machine Learning", SC'19.

Rounds: log2 p (p = 2^⌊log2 P⌋); in round i partners whose numbers differ in bit i swap
their whole running sums and both merge them, lower rank's run first. A sum travels as
pairs while nnz·(index + value bytes) < n·value bytes, else as n dense values (and stays
dense). Size and form go first (8 bytes); pairs follow as one packed message up to
:data:`PACK_LIMIT` bytes, beyond it as two (indices, values), each received into the array it
becomes. With ``wire="compact"`` a sparse sum travels as :mod:`sparsecoll.wire` messages
in pieces (:mod:`._pieces`), their byte sizes sent with the size: each piece is decoded and
merged as it lands, so that work overlaps the transfer (the dense switch stays the raw
one). Non-power-of-two P
folds the first 2(P − p) ranks in pairs (:class:`~.base.Fold`).
Volume sent per rank: Σ_i bytes(K_i), K_i the nnz held entering round i (identical indices:
k·log2 p pairs; disjoint: ≈ k(p−1), capped at n values a round). Latency: log2 p exchanges
(+2 when folding): best for small messages.

Exact and bit-identical on every rank; an entry of a sum that went dense is returned only
where it is nonzero. Rows (``x.width`` = D): an index and D values a pair, n rows dense.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._array import get_array_module, index_dtype, nonzero_positions
from ..comm import Communicator, Request
from ..registry import register_algorithm
from ..sparse import SparseVector
from . import _pieces
from ._merge import add_sparse, merge_two
from ._wire import WireOption
from .base import Algorithm, Fold, pack_pairs, sparse_is_cheaper, unpack_pairs

__all__ = ["RecursiveDoubling"]

TAG = 31
PAIRS, DENSE, PIECES = 0, 1, 2  # a message's form, sent with its size
PACK_LIMIT = 1 << 16  # pairs up to this many bytes travel packed: one message, not two


@register_algorithm
class RecursiveDoubling(WireOption, Algorithm):
    name = "recursive_doubling"
    takes_rows = True

    def preflight(self, x: SparseVector) -> None:
        # an input past the switch point starts dense: made before the ranks agree, so
        # memory running out here is an error on every rank
        if not sparse_is_cheaper(x.nnz, x.n, index_dtype(x.n), x.dtype, x.width):
            x.info["dense"] = x.to_dense()

    def reduce(self, comm: Communicator, x: SparseVector) -> SparseVector:
        dense = x.info.pop("dense", None)
        if comm.size == 1:
            return SparseVector(x.indices.copy(), x.values.copy(), x.n)
        fold = Fold.plan(comm.rank, comm.size)
        if dense is not None:
            state = _Vector(None, dense, x.n, True)
        else:
            state = _Vector.sparse(x.indices, x.values, x.n)
        compact = self.compact(x)
        if fold.folded:
            Request.waitall(_exchange(comm, fold.partner, state, compact, x)[1])
            got = _exchange(comm, fold.partner, None, compact, x)[0]
            return _Vector.received(got, x).result()
        if fold.partner >= 0:  # the folded partner is the lower rank: its run goes first
            state = state.merge(_exchange(comm, fold.partner, None, compact, x)[0], False)
        mask = 1
        while mask < fold.pof2:
            peer_new = fold.newrank ^ mask
            other, sent = _exchange(comm, fold.real_rank(peer_new), state, compact, x)
            state = state.merge(other, fold.newrank < peer_new)
            Request.waitall(sent)
            mask <<= 1
        if fold.partner >= 0:
            Request.waitall(_exchange(comm, fold.partner, state, compact, x)[1])
        return state.result()


def _exchange(
    comm: Communicator, peer: int, state: _Vector | None, compact: bool, like: SparseVector
) -> tuple[_Vector | _pieces.Incoming | None, list[Request]]:
    """Swap running sums with ``peer`` (``state`` None: only receive): what came, received
    or (pieces) arriving, and the sends to complete after it is merged.

    Size and form go first, as 4 * size + form (size: bytes, or pairs for PIECES), with
    ``compact`` the pieces' byte sizes after it, so no receive probes (a probe costs far
    more than a small exchange on an oversubscribed node), and the parts are received
    straight into the arrays they become.
    """
    parts, form = ([], -1) if state is None else state.encode(compact)
    size = state.indices.shape[0] if form == PIECES else sum(int(p.nbytes) for p in parts)
    head = [-1 if state is None else 4 * size + form]
    if compact:
        sizes = [int(p.nbytes) for p in parts] if form == PIECES else []
        head += sizes + [0] * (_pieces.MAX_PIECES - len(sizes))
    theirs = comm.sendrecv_ints(head, peer, peer, TAG)
    size, their_form = divmod(theirs[0], 4)
    got: _Vector | _pieces.Incoming | None = None
    if theirs[0] >= 0 and their_form == PIECES:
        itype = index_dtype(like.n)
        got = _pieces.Incoming(
            comm, peer, TAG, size, theirs[1:], itype, like.dtype, like.n, like.width
        )
    recv = _Vector.buffers(size, their_form, like) if got is None and theirs[0] >= 0 else []
    reqs = [comm.irecv(p, peer, TAG) for p in recv if p.nbytes]
    sent = [comm.isend(p, peer, TAG) for p in parts if p.nbytes]
    if got is None and theirs[0] >= 0:
        Request.waitall(reqs)
        got = _Vector.decode(recv, their_form, like)
    return got, sent


class _Vector:
    """A rank's running sum: sparse (indices, values) or dense (n values)."""

    __slots__ = ("dense", "indices", "n", "values")

    def __init__(self, indices: Any, values: Any, n: int, dense: bool) -> None:
        self.indices, self.values, self.n, self.dense = indices, values, n, dense

    @classmethod
    def sparse(cls, indices: Any, values: Any, n: int) -> _Vector:
        """A sparse vector, switched to dense when that is the cheaper message."""
        width = values.shape[1] if values.ndim == 2 else None
        if sparse_is_cheaper(indices.shape[0], n, index_dtype(n), values.dtype, width):
            return cls(indices, values, n, False)
        xp = get_array_module(values)
        out = xp.zeros((n, *values.shape[1:]), values.dtype)
        out[indices] = values
        return cls(None, out, n, True)

    def encode(self, compact: bool) -> tuple[list[Any], int]:
        """The message's parts (sent in order, without a copy where raw; compact: the
        pieces) and its form."""
        xp = get_array_module(self.values)
        if self.dense:
            return [xp.ascontiguousarray(self.values)], DENSE
        if compact:
            return _pieces.encode(self.indices, self.values, self.n), PIECES
        if self.indices.nbytes + self.values.nbytes <= PACK_LIMIT:
            return [pack_pairs(self.indices, self.values)], PAIRS
        return [xp.ascontiguousarray(self.indices), xp.ascontiguousarray(self.values)], PAIRS

    @staticmethod
    def buffers(size: int, form: int, like: SparseVector) -> list[Any]:
        """Empty arrays for the parts of a message of ``size`` bytes and this form."""
        xp, n, vtype, row, itype = like.xp, like.n, like.dtype, like.row_shape, index_dtype(like.n)
        if form == DENSE:
            return [xp.empty((n, *row), vtype)]
        if size <= PACK_LIMIT:
            return [xp.empty(size, np.uint8)]
        nnz = size // (itype.itemsize + vtype.itemsize * (like.width or 1))
        return [xp.empty(nnz, itype), xp.empty((nnz, *row), vtype)]

    @classmethod
    def decode(cls, parts: list[Any], form: int, like: SparseVector) -> _Vector:
        if form == DENSE:
            return cls(None, parts[0], like.n, True)
        if len(parts) == 1:
            idx, vals = unpack_pairs(parts[0], index_dtype(like.n), like.dtype, like.width)
            return cls(idx, vals, like.n, False)
        return cls(parts[0], parts[1], like.n, False)

    @classmethod
    def received(cls, got: _Vector | _pieces.Incoming, like: SparseVector) -> _Vector:
        """What :func:`_exchange` got, as a vector (pieces read and joined)."""
        if isinstance(got, _Vector):
            return got
        empty = cls(
            like.xp.empty(0, index_dtype(like.n)),
            like.xp.empty((0, *like.row_shape), like.dtype),
            like.n,
            False,
        )
        return empty.merge(got, True)

    def merge(self, other: _Vector | _pieces.Incoming, first: bool) -> _Vector:
        """``self + other`` (``first``: self is the first operand); dense if either is."""
        if isinstance(other, _pieces.Incoming):
            if not self.dense:
                idx, vals = _pieces.merge_into(self.indices, self.values, other, first)
                return _Vector.sparse(idx, vals, self.n)
            out = self.values.copy()
            for idx, vals in other:
                add_sparse(out, idx, vals, 0)
            return _Vector(None, out, self.n, True)
        if not self.dense and not other.dense:
            a, b = (self, other) if first else (other, self)
            idx, vals = merge_two(a.indices, a.values, b.indices, b.values, self.n)
            return _Vector.sparse(idx, vals, self.n)
        if self.dense and other.dense:
            return _Vector(None, self.values + other.values, self.n, True)
        d, s = (self, other) if self.dense else (other, self)
        out = d.values.copy()
        add_sparse(out, s.indices, s.values, 0)
        return _Vector(None, out, self.n, True)

    def result(self) -> SparseVector:
        if not self.dense:
            return SparseVector(self.indices, self.values, self.n)
        nz = nonzero_positions(self.values)
        return SparseVector(nz.astype(index_dtype(self.n)), self.values[nz], self.n)
