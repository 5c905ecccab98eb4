"""gtopk: global top-k by recursive doubling (Shi et al., ICDCS'19), for any number of ranks.

Rounds: each rank keeps its local top-k; extra ranks fold in pairs (:class:`~.base.Fold`);
then in each of log2 p rounds partners swap their k-sparse sets, sum equal indices and keep
the top k by |value|. Both merge the same two sets, so no broadcast is needed.
Volume per rank: ≤ k pairs each way per round, 2k·log2 p in all; folding adds k pairs each
way and a k-bit mask. Indices travel as ``index_dtype(n)``, never inside float buffers.

Contract: the result equals the same merge tree computed sequentially (:func:`gtopk_tree`),
on every rank: at most k entries, sorted, no zeros, ties in |value| to the lower index; a
+inf + -inf sum is NaN and ranks above every number. It is the exact global top-k when no
subtree drops an entry; otherwise approximate by design. ``result.contributed`` marks this
rank's entries that survived every merge they took part in (tracked per round, not read off
the final index set), so ``sum of results + sum of residuals == sum of inputs`` up to rounding.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from .. import _state, select
from .._array import get_array_module, nonzero_mask, to_host
from ..comm import Communicator
from ..registry import register_algorithm
from ..sparse import SparseVector
from ._merge import isin_sorted, merge_two
from .base import Algorithm, Fold, allclose_sparse, pack_pairs, recv_pairs

__all__ = ["GTopk", "check_k", "gtopk_tree", "isin_sorted", "merge_topk", "topk_positions"]

TAG = 31


def check_k(name: str, k: Any) -> int:
    """Validate the ``k`` option (an int >= 0) and return it."""
    if k is None:
        raise TypeError(f"algorithm {name!r} needs k= (entries to keep)")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"k must be an integer, got {type(k).__name__}")
    if k < 0:
        raise ValueError(f"k must be non-negative, got {k}")
    if k >= 2**63:  # (agreed across ranks as an int64; any k >= n keeps everything)
        raise ValueError(f"k must be below 2**63, got {k}")
    return int(k)


def topk_positions(values: Any, k: int) -> Any:
    """Return the ascending positions of the ``k`` largest nonzero ``|values|``.

    Ties go to the lower position (on a coalesced vector: the lower index); fewer than k
    come back when fewer than k values are nonzero.
    """
    if k == 0 or values.shape[0] == 0:
        return get_array_module(values).zeros(0, dtype=np.int64)
    pos, picked = select.topk(values, min(k, int(values.shape[0])))
    return pos[nonzero_mask(picked)]


def merge_topk(a: tuple[Any, Any], b: tuple[Any, Any], k: int, n: int) -> tuple[Any, Any]:
    """Sum two coalesced (indices, values) sets and keep the top k (:func:`topk_positions`).

    Symmetric (a + b == b + a at each index), so both partners of a round get the same bits.
    """
    idx, vals = merge_two(a[0], a[1], b[0], b[1], n)
    xp = get_array_module(vals)
    nan = xp.isnan(vals)
    if not bool(nan.any()):
        pos = topk_positions(vals, k)
    else:  # inf + (-inf) met here: NaN (as in the dense sum), ranked above every number
        pos = xp.flatnonzero(nan)[:k]
        rest = xp.flatnonzero(~nan)
        if pos.shape[0] < k and rest.shape[0]:
            pos = xp.sort(xp.concatenate([pos, rest[topk_positions(vals[rest], k - pos.shape[0])]]))
    return idx[pos], vals[pos]


def _local_topk(x: SparseVector, k: int, copy: bool) -> tuple[Any, tuple[Any, Any]]:
    """Return this rank's top-k positions in x and (indices, values).

    The pair is x's own arrays when every entry is kept, unless ``copy``.
    """
    if x.nnz <= k and bool(nonzero_mask(x.values).all()):
        pos = x.xp.arange(x.nnz)
        return pos, (x.indices.copy(), x.values.copy()) if copy else (x.indices, x.values)
    pos = topk_positions(x.values, k)
    return pos, (x.indices[pos], x.values[pos])


def _mask_over(x: SparseVector, pos: Any, alive: Any) -> Any:
    if pos.shape[0] == x.nnz:  # ascending positions, all of x: alive is the mask
        return alive
    mask = x.xp.zeros(x.nnz, dtype=bool)
    mask[pos[alive]] = True
    return mask


@register_algorithm
class GTopk(Algorithm):
    """Global top-k sparse allreduce by recursive doubling.

    Args:
        k: entries to keep (int >= 0); the same on every rank.
    """

    name = "gtopk"
    exact = False
    required = ("k",)
    state_kinds: ClassVar[dict[str, _state.Kind] | None] = {}  # (k is the constructor's)
    fixed_options: ClassVar[tuple[str, ...]] = ("k",)

    def __init__(self, k: int | None = None) -> None:
        self.k = check_k(self.name, k)

    @classmethod
    def default_options(cls, n: int, k: int) -> dict[str, Any]:
        return {"k": k}

    def signature(self) -> list[int]:
        return [self.k]

    def reduce(self, comm: Communicator, x: SparseVector) -> SparseVector:
        k, n = self.k, x.n
        xp = x.xp
        pos, cur = _local_topk(x, k, copy=comm.size == 1)
        alive = xp.ones(pos.shape[0], dtype=bool)  # own local top-k entries still in `cur`
        fold = Fold.plan(comm.rank, comm.size)
        rounds = 0
        if comm.size > 1 and k > 0:
            if fold.folded:
                comm.send(pack_pairs(*cur), fold.partner, TAG)
                res_idx, res_val = recv_pairs(comm, fold.partner, TAG, n, x.dtype, xp)
                res_idx, res_val = res_idx.copy(), res_val.copy()
                bits = xp.zeros((pos.shape[0] + 7) // 8, dtype=np.uint8)
                comm.recv(bits, fold.partner, TAG)
                alive = _unpack_bits(bits, pos.shape[0], xp)
                cur = (res_idx, res_val)
            else:
                tracked = [(cur[0], alive)]  # (indices, alive) of contributions riding in cur
                if fold.partner >= 0:
                    theirs = _copy(recv_pairs(comm, fold.partner, TAG, n, x.dtype, xp))
                    tracked.append((theirs[0], xp.ones(theirs[0].shape[0], dtype=bool)))
                    cur = merge_topk(theirs, cur, k, n)
                    tracked = [(i, a & isin_sorted(i, cur[0])) for i, a in tracked]
                mask = 1
                while mask < fold.pof2:
                    peer = fold.real_rank(fold.newrank ^ mask)
                    req = comm.isend(pack_pairs(*cur), peer, TAG)
                    other = _copy(recv_pairs(comm, peer, TAG, n, x.dtype, xp))
                    req.wait()
                    # lower newrank first: the same order on both partners
                    pair = (cur, other) if fold.newrank & mask == 0 else (other, cur)
                    cur = merge_topk(*pair, k, n)
                    tracked = [(i, a & isin_sorted(i, cur[0])) for i, a in tracked]
                    mask <<= 1
                    rounds += 1
                alive = tracked[0][1]
                if fold.partner >= 0:
                    comm.send(pack_pairs(*cur), fold.partner, TAG)
                    comm.send(_pack_bits(tracked[1][1], xp), fold.partner, TAG)
        out = SparseVector(cur[0], cur[1], n)
        out.contributed = _mask_over(x, pos, alive)
        out.local = x
        out.info.update(k=k, rounds=rounds, folded=fold.folded and comm.size > 1)
        return out

    def verify(
        self, result: SparseVector, reference: SparseVector, inputs: list[SparseVector]
    ) -> bool:
        """Whether ``result`` equals the sequential merge tree on ``inputs`` (up to rounding)."""
        want, _ = gtopk_tree(inputs, self.k)
        if result.nnz != want.nnz:
            return False
        ri = to_host(result.indices)
        wi = to_host(want.indices)
        return bool(np.array_equal(ri, wi)) and allclose_sparse(result, want, inputs)


def _copy(pair: tuple[Any, Any]) -> tuple[Any, Any]:
    # views into a received byte buffer: copy so indices/values are aligned, owned arrays
    return pair[0].copy(), pair[1].copy()


def _pack_bits(mask: Any, xp: Any) -> Any:
    return xp.packbits(mask.astype(np.uint8))


def _unpack_bits(bits: Any, m: int, xp: Any) -> Any:
    return xp.unpackbits(bits)[:m].astype(bool)


def gtopk_tree(inputs: list[SparseVector], k: int) -> tuple[SparseVector, list[Any]]:
    """Compute the gtopk merge tree sequentially on every rank's coalesced input.

    The reference the distributed algorithm equals bit for bit.

    Returns:
        The result, and per rank the contributed mask over that rank's input.
    """
    size = len(inputs)
    n = inputs[0].n
    tops = [_local_topk(x, k, copy=True) for x in inputs]
    alive = [np.ones(t[0].shape[0], dtype=bool) for t in tops]
    # a group: (its current set, the ranks whose entries ride in it)
    pof2 = 1 << (size.bit_length() - 1)
    rem = size - pof2
    groups: list[tuple[tuple[Any, Any], list[int]]] = []
    for r in range(size):
        if r < 2 * rem and r % 2 == 0:
            continue
        if r < 2 * rem:
            groups.append((merge_topk(tops[r - 1][1], tops[r][1], k, n), [r - 1, r]))
        else:
            groups.append((tops[r][1], [r]))

    def survive(kept: tuple[Any, Any], members: list[int]) -> None:
        for r in members:
            alive[r] &= isin_sorted(tops[r][1][0], kept[0])

    if size > 1 and k > 0:
        for cur, members in groups:
            survive(cur, members)
        mask = 1
        while mask < pof2:
            new = list(groups)
            for v in range(pof2):
                w = v ^ mask
                if v < w:
                    kept = merge_topk(groups[v][0], groups[w][0], k, n)
                    members = groups[v][1] + groups[w][1]
                    survive(kept, members)
                    new[v] = new[w] = (kept, members)
            groups = new
            mask <<= 1
    result = SparseVector(groups[0][0][0], groups[0][0][1], n)
    masks = [_mask_over(x, t[0], a) for x, t, a in zip(inputs, tops, alive)]
    return result, masks
