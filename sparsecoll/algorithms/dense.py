"""dense: densify, MPI_Allreduce, sparsify. The correctness reference.

Volume per rank: 2·(P−1)/P·n values (counted as a bandwidth-optimal allreduce moves them).
Result: the nonzeros of the dense sum (entries that cancel to exactly 0 are dropped; rows:
those holding a nonzero).
"""

from __future__ import annotations

from ..comm import Communicator, widening_buffer
from ..registry import register_algorithm
from ..sparse import SparseVector
from .base import Algorithm, dense_of

__all__ = ["Dense"]


@register_algorithm
class Dense(Algorithm):
    name = "dense"
    takes_rows = True
    densifies = True

    def preflight(self, x: SparseVector) -> None:
        # made before the ranks agree: the dense array and (float16) the float32 one it is
        # summed in
        x.info["dense"] = dense = x.to_dense()
        x.info["work"] = widening_buffer(dense)

    def reduce(self, comm: Communicator, x: SparseVector) -> SparseVector:
        dense = dense_of(x)  # a new array: summed in place
        work = x.info.pop("work", None)
        return SparseVector.from_dense(comm.allreduce(dense, out=dense, check=False, work=work))
