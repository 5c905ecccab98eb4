"""A sorted run sent as compact wire messages in pieces, so decoding and merging overlap the
transfer.

A run of m pairs travels as :func:`count` (m) :mod:`sparsecoll.wire` messages of
consecutive pairs, piece j holding pairs [j·m // c, (j + 1)·m // c). The pieces' byte sizes
go ahead with the exchange's metadata, so the receiver posts every piece's receive up front
at its exact size, decodes each piece as it lands while the later ones are still on the
link, and :func:`merge_into` merges a sorted run with them one index segment at a time.
Results are those of one message: the same pairs, decoded to the same bits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..comm import Communicator, Request
from ._merge import accumulate_dtype, merge_at
from ._wire import decode_pairs, encode_pairs, message_space

__all__ = ["MAX_PIECES", "Incoming", "count", "encode", "merge_into"]

MIN_PIECE = 1 << 15  # pairs: a smaller piece overlaps less than its message costs
MAX_PIECES = 8


def count(m: int) -> int:
    """Pieces a run of m pairs travels in (one at least)."""
    return max(1, min(MAX_PIECES, m // MIN_PIECE))


def _bounds(m: int) -> list[int]:
    c = count(m)
    return [j * m // c for j in range(c + 1)]


def encode(idx: Any, vals: Any, n: int) -> list[np.ndarray]:
    """The run's pieces (indices in [0, n)), each one wire message."""
    b = _bounds(idx.shape[0])
    return [
        encode_pairs(idx[b[j] : b[j + 1]], vals[b[j] : b[j + 1]], 0, n) for j in range(len(b) - 1)
    ]


class Incoming:
    """The pieces of a run of m pairs from ``peer`` (their byte sizes given), their
    receives posted on creation."""

    def __init__(
        self, comm: Communicator, peer: int, tag: int, m: int, sizes: Sequence[int],
        itype: Any, vtype: Any, n: int, width: int | None,
    ) -> None:  # fmt: skip
        self.m, self.n, self.itype, self.vtype, self.width = m, n, itype, vtype, width
        self.parts = message_space(sizes[: count(m)])  # (each decoded where it lands)
        self.reqs: list[Request] = [comm.irecv(p, peer, tag) for p in self.parts]

    def __len__(self) -> int:
        return len(self.parts)

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Each piece's (indices, values), in order, as it lands."""
        for req, part in zip(self.reqs, self.parts):
            req.wait()
            yield decode_pairs(part, self.itype, self.vtype, 0, self.n, self.width)


def merge_into(idx: Any, vals: Any, pieces: Incoming, mine_first: bool) -> tuple[Any, Any]:
    """Merge the coalesced host run (idx, vals) with the pieces' run, one segment per
    piece: piece j with the run's entries up to its last index (the last piece: all the
    rest). ``mine_first``: the run is the merge's first operand (IEEE sums are the same bits
    either way; the operands' order is kept for the record)."""
    m = idx.shape[0] + pieces.m
    out_i = np.empty(m, idx.dtype)
    out_v = np.empty((m, *vals.shape[1:]), accumulate_dtype(vals.dtype))
    o, start, last = 0, 0, len(pieces) - 1
    for j, (pi, pv) in enumerate(pieces):
        stop = idx.shape[0]
        if j < last and pi.shape[0]:
            stop = int(np.searchsorted(idx, pi[-1], side="right"))
        a, b = (idx[start:stop], vals[start:stop]), (pi, pv)
        o = merge_at(*a, *b, out_i, out_v, o) if mine_first else merge_at(*b, *a, out_i, out_v, o)
        start = stop
    return out_i[:o], out_v[:o].astype(vals.dtype, copy=False)
