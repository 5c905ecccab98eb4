"""allgather (TopkA): allgatherv of every rank's pairs, then one local coalesce.

Volume per rank: receives the other ranks' pairs, Σ_{s≠r} k_s·(index + value bytes), in
two allgatherv calls (indices, values) after one exchange of counts. O(kP): the baseline.
Exact: every rank sums the same gathered pairs in the same (rank) order, so the result is
bit-identical on every rank.
"""

from __future__ import annotations

from ..comm import Communicator
from ..registry import register_algorithm
from ..sparse import SparseVector, coalesce
from .base import Algorithm

__all__ = ["Allgather"]


@register_algorithm
class Allgather(Algorithm):
    name = "allgather"

    def reduce(self, comm: Communicator, x: SparseVector) -> SparseVector:
        idx, counts = comm.allgatherv(x.indices)
        vals, _ = comm.allgatherv(x.values, counts)
        return coalesce(idx, vals, x.n)
