"""rabenseifner: dense allreduce by recursive-halving reduce-scatter, then recursive-doubling
allgather, on the Communicator's point-to-point primitives.

Any P: with r = P − 2^⌊log2 P⌋, the first 2r ranks fold in pairs before (even hands its
vector to odd) and unfold after, as MPICH does (:class:`~.base.Fold`).
Volume per rank (p = 2^⌊log2 P⌋): 2·(p−1)/p·n values in the power-of-two group (+ n for
a rank returning the result to its folded partner); n for a folded rank.
Result: the nonzeros of the dense sum (rows: an ``(n, D)`` array, split by rows; the rows
holding a nonzero).

Memory: the dense vector and a scratch of n values, both made in ``preflight`` (before the
ranks agree, so that memory running out on one rank is an error on every rank): 2n values
on every rank, folded ones included.
"""

from __future__ import annotations

from .._array import get_array_module
from ..comm import Communicator
from ..registry import register_algorithm
from ..sparse import SparseVector
from .base import Algorithm, Fold, dense_of, range_bounds

__all__ = ["Rabenseifner"]

TAG = 11


@register_algorithm
class Rabenseifner(Algorithm):
    name = "rabenseifner"
    takes_rows = True
    densifies = True

    def preflight(self, x: SparseVector) -> None:
        x.info["dense"] = dense = x.to_dense()
        x.info["scratch"] = get_array_module(dense).empty_like(dense)

    def reduce(self, comm: Communicator, x: SparseVector) -> SparseVector:
        scratch = x.info.pop("scratch", None)
        return SparseVector.from_dense(allreduce_dense(comm, dense_of(x), scratch))


def allreduce_dense(comm: Communicator, buf, scratch=None):
    """Sum the dense array ``buf`` over ``comm`` in place; return it (``scratch`` made if None)."""
    fold = Fold.plan(comm.rank, comm.size)
    if comm.size == 1:
        return buf
    if fold.folded:
        comm.send(buf, fold.partner, TAG)
        comm.recv(buf, fold.partner, TAG)
        return buf
    if scratch is None:
        scratch = get_array_module(buf).empty_like(buf)
    if fold.partner >= 0:
        comm.recv(scratch, fold.partner, TAG)
        buf += scratch
    p, v = fold.pof2, fold.newrank
    bounds = range_bounds(buf.shape[0], p)
    lo, hi = 0, p  # block range this rank is responsible for
    mask = p >> 1
    while mask:  # reduce-scatter by recursive halving
        peer = fold.real_rank(v ^ mask)
        mid = (lo + hi) // 2
        (klo, khi), (slo, shi) = ((lo, mid), (mid, hi)) if not v & mask else ((mid, hi), (lo, mid))
        recv = scratch[: bounds[khi] - bounds[klo]]
        comm.sendrecv(buf[bounds[slo] : bounds[shi]], peer, recv, peer, TAG)
        buf[bounds[klo] : bounds[khi]] += recv
        lo, hi = klo, khi
        mask >>= 1
    mask = 1
    while mask < p:  # allgather by recursive doubling
        peer = fold.real_rank(v ^ mask)
        plo = lo ^ mask  # lo is aligned to mask: the peer holds the mirror range
        phi = plo + (hi - lo)
        recv = buf[bounds[plo] : bounds[phi]]
        comm.sendrecv(buf[bounds[lo] : bounds[hi]], peer, recv, peer, TAG)
        lo, hi = min(lo, plo), max(hi, phi)
        mask <<= 1
    if fold.partner >= 0:
        comm.send(buf, fold.partner, TAG)
    return buf
