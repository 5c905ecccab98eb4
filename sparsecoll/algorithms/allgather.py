"""allgather (TopkA): allgatherv of every rank's pairs, then one local merge of the P runs.

Volume per rank: receives the other ranks' pairs, Σ_{s≠r} k_s·(index + value bytes), in
one allgatherv of every rank's packed pairs (its index bytes, then its value bytes) after one
exchange of counts. O(kP): the baseline.
Exact: every rank sums the same gathered runs in the same (pairwise, by rank) order, so the
result is bit-identical on every rank.
"""

from __future__ import annotations

from typing import Any

from ..comm import Communicator
from ..registry import register_algorithm
from ..sparse import SparseVector
from ._merge import accumulate_dtype, merge_two
from .base import Algorithm, pack_pairs, unpack_pairs

__all__ = ["Allgather"]


@register_algorithm
class Allgather(Algorithm):
    name = "allgather"

    def reduce(self, comm: Communicator, x: SparseVector) -> SparseVector:
        # (one allgatherv of the packed pairs: gathering the indices and the values apart
        # was one collective more per call, as the counts travel once either way)
        buf, sizes = comm.allgatherv(pack_pairs(x.indices, x.values))
        runs, start = [], 0
        for size in sizes:
            if size:
                runs.append(unpack_pairs(buf[start : start + size], x.indices.dtype, x.dtype))
            start += size
        if not runs:
            return SparseVector.empty(x.n, x.dtype, x.xp)
        return SparseVector(*merge_runs(runs, x.n), x.n)


def merge_runs(runs: list[tuple[Any, Any]], n: int) -> tuple[Any, Any]:
    """Sum nonempty coalesced runs ``(indices, values)`` (rank order) by merging neighbours
    pairwise, log2 P linear passes instead of sorting the concatenation. The pairing
    depends only on the number of runs, so every rank adds in the same order and gets the
    same bits. float16 values are summed in float64 and rounded once, at the end."""
    dtype = runs[0][1].dtype
    acc = accumulate_dtype(dtype)
    runs = [(i, v.astype(acc, copy=False)) for i, v in runs]
    while len(runs) > 1:
        pairs = [merge_two(*runs[j], *runs[j + 1], n) for j in range(0, len(runs) - 1, 2)]
        runs = pairs + ([runs[-1]] if len(runs) % 2 else [])
    return runs[0][0], runs[0][1].astype(dtype, copy=False)
