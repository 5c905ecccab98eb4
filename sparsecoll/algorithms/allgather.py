"""allgather (TopkA): gather every rank's pairs, then merge the P runs locally.

Rounds: one exchange of counts, then one allgatherv of every rank's packed pairs (index
bytes, then value bytes; with ``wire="compact"`` one :mod:`sparsecoll.wire` message, sent
with zero bytes to a multiple of 8 so that each lands 8-aligned and decodes where it lies).
Volume per rank: receives Σ_{s≠r} k_s pairs, O(kP): the baseline.
Exact: every rank merges the same runs in the same order, so the result is bit-identical
on every rank. Rows (``x.width``) travel as an index and D values a pair.
"""

from __future__ import annotations

from typing import Any

from ..comm import Communicator
from ..registry import register_algorithm
from ..sparse import SparseVector
from ._merge import accumulate_dtype, merge_two
from ._wire import WireOption, decode_pairs, encode_pairs, padded, slot, width
from .base import Algorithm, pack_pairs, unpack_pairs

__all__ = ["Allgather"]


@register_algorithm
class Allgather(WireOption, Algorithm):
    name = "allgather"
    takes_rows = True

    def reduce(self, comm: Communicator, x: SparseVector) -> SparseVector:
        # indices and values packed together: one allgatherv, one exchange of counts
        compact = self.compact(x)
        if compact:
            msg = encode_pairs(x.indices, x.values, 0, x.n)
            sizes = [int(s) for s in comm.allgather_ints(msg.shape[0])]
            spans = [slot(s) for s in sizes]
            buf, _ = comm.allgatherv(padded(msg), spans)
        else:
            buf, sizes = comm.allgatherv(pack_pairs(x.indices, x.values))
            spans = sizes
        runs, start = [], 0
        for r, (size, span) in enumerate(zip(sizes, spans, strict=True)):
            part = buf[start : start + size]
            if compact:
                if r == comm.rank:  # (its own message decodes to its own pairs, bit for bit)
                    run = (x.indices, x.values)
                else:
                    run = decode_pairs(part, x.indices.dtype, x.dtype, 0, x.n, width(x.values))
                if run[0].shape[0]:
                    runs.append(run)
            elif size:
                runs.append(unpack_pairs(part, x.indices.dtype, x.dtype, x.width))
            start += span
        if not runs:
            return SparseVector.empty(x.n, x.dtype, x.xp, x.width)
        idx, val = merge_runs(runs, x.n)
        if idx is x.indices:  # (this rank's pairs alone: the result owns its memory)
            idx, val = idx.copy(), val.copy()
        return SparseVector(idx, val, x.n)


def merge_runs(runs: list[tuple[Any, Any]], n: int) -> tuple[Any, Any]:
    """Sum nonempty coalesced runs ``(indices, values)``, given in rank order.

    Neighbours merge pairwise; the pairing depends only on the number of runs, so every
    rank gets the same bits. float16 is summed in float64 and rounded once.
    """
    dtype = runs[0][1].dtype
    acc = accumulate_dtype(dtype)
    runs = [(i, v.astype(acc, copy=False)) for i, v in runs]
    while len(runs) > 1:
        pairs = [merge_two(*runs[j], *runs[j + 1], n) for j in range(0, len(runs) - 1, 2)]
        runs = pairs + ([runs[-1]] if len(runs) % 2 else [])
    return runs[0][0], runs[0][1].astype(dtype, copy=False)
