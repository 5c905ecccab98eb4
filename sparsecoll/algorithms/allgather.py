"""allgather (TopkA): allgatherv of every rank's pairs, then one local merge of the P runs.

Volume per rank: receives the other ranks' pairs, Σ_{s≠r} k_s·(index + value bytes), in
two allgatherv calls (indices, values) after one exchange of counts. O(kP): the baseline.
Exact: every rank sums the same gathered runs in the same (pairwise, by rank) order, so the
result is bit-identical on every rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..comm import Communicator
from ..registry import register_algorithm
from ..sparse import SparseVector
from ._merge import accumulate_dtype, merge_two
from .base import Algorithm

__all__ = ["Allgather"]


@register_algorithm
class Allgather(Algorithm):
    name = "allgather"

    def reduce(self, comm: Communicator, x: SparseVector) -> SparseVector:
        idx, counts = comm.allgatherv(x.indices)
        vals, _ = comm.allgatherv(x.values, counts)
        return SparseVector(*merge_runs(idx, vals, counts, x.n), x.n)


def merge_runs(idx: Any, vals: Any, counts: list[int], n: int) -> tuple[Any, Any]:
    """Sum P gathered coalesced runs (rank order) by merging neighbours pairwise, log2 P
    linear passes instead of sorting the concatenation. The pairing depends only on the
    counts, so every rank adds in the same order and gets the same bits. float16 values are
    summed in float64 and rounded once, at the end."""
    dtype = vals.dtype
    vals = vals.astype(accumulate_dtype(dtype), copy=False)
    ends = np.cumsum([0, *counts])
    runs = [(idx[a:b], vals[a:b]) for a, b in zip(ends[:-1].tolist(), ends[1:].tolist())]
    runs = [r for r in runs if r[0].shape[0]]
    if not runs:
        return idx[:0], vals[:0].astype(dtype)
    while len(runs) > 1:
        pairs = [merge_two(*runs[j], *runs[j + 1], n) for j in range(0, len(runs) - 1, 2)]
        runs = pairs + ([runs[-1]] if len(runs) % 2 else [])
    return runs[0][0], runs[0][1].astype(dtype, copy=False)
