"""Relabel the blocks of sorted coordinates by a permutation, and sort by the new labels.

The hashed algorithm moves indices in blocks of B = 2**shift: i ↦ π(i >> shift)·B + (i mod B).
A sorted array of coordinates is a sequence of segments, one per block, each ascending;
:func:`relabel` sorts the segments by their new labels and keeps each one's order, so its
output is sorted in the new space. Work: one pass over the entries, plus sorting one label
per segment: by rank in a bitmap of the labels (prefix popcounts, O(S + labels/64)) while
they are dense enough, else by an argsort. On a GPU: an argsort of the entries' labels.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .._array import get_array_module, stable_argsort
from .._jit import cached_njit
from ._hashperm import AffinePermutation

__all__ = ["relabel"]

RANK_SORT = 512  # labels are ranked in a bitmap while their count n <= RANK_SORT·segments


def relabel(coords: Any, perm: AffinePermutation, shift: int) -> tuple[Any, Any]:
    """Return ``(new, order)``: the relabelled coordinates, ascending, and where each came from.

    ``coords`` ascend and their blocks ``coords >> shift`` lie in [0, perm.n); ``new[j] =
    perm(c >> shift) << shift | (c & (2**shift − 1))`` for ``c = coords[order[j]]`` (int64).
    """
    xp = get_array_module(coords)
    m = int(coords.shape[0])
    if m == 0:
        return xp.zeros(0, np.int64), xp.zeros(0, np.int64)
    c = coords.astype(np.int64, copy=False)
    blocks = c >> shift
    heads = xp.flatnonzero(blocks[1:] != blocks[:-1]) + 1
    heads = xp.concatenate((xp.zeros(1, heads.dtype), heads)).astype(np.int64)
    labels = perm.apply(blocks[heads])
    mask = (1 << shift) - 1
    if xp is not np:
        first = xp.zeros(m, np.int64)
        first[heads] = 1
        each = labels[xp.cumsum(first) - 1]  # each entry's segment's label
        order = stable_argsort(each, perm.n)
        return (each[order] << shift) | (c[order] & mask), order
    new = np.empty(m, np.int64)
    order = np.empty(m, np.int64)
    use_rank = perm.n <= RANK_SORT * int(heads.shape[0])
    _kernel()(np.ascontiguousarray(c), heads, labels, shift, perm.n, use_rank, new, order)
    return new, order


@functools.cache
def _kernel() -> Any:
    @cached_njit(nogil=True)
    def popcount(v):  # pragma: no cover - compiled
        v = v - ((v >> np.uint64(1)) & np.uint64(0x5555555555555555))
        v = (v & np.uint64(0x3333333333333333)) + (
            (v >> np.uint64(2)) & np.uint64(0x3333333333333333)
        )
        v = (v + (v >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
        return np.int64((v * np.uint64(0x0101010101010101)) >> np.uint64(56))

    @cached_njit(nogil=True)
    def relabel_sorted(coords, heads, labels, shift, n, use_rank, new, order):  # pragma: no cover
        # labels are unique (one per block): segment s goes to place rank[s] among them
        segs = heads.shape[0]
        m = coords.shape[0]
        rank = np.empty(segs, np.int64)
        if use_rank:
            words = (n + 63) >> 6
            bits = np.zeros(words, np.uint64)
            for s in range(segs):
                k = labels[s]
                bits[k >> 6] |= np.uint64(1) << np.uint64(k & 63)
            below = np.empty(words, np.int64)
            total = 0
            for w in range(words):
                below[w] = total
                total += popcount(bits[w])
            for s in range(segs):
                k = labels[s]
                low = bits[k >> 6] & ((np.uint64(1) << np.uint64(k & 63)) - np.uint64(1))
                rank[s] = below[k >> 6] + popcount(low)
        else:
            by_label = np.argsort(labels)
            for j in range(segs):
                rank[by_label[j]] = j
        start = np.zeros(segs + 1, np.int64)
        for s in range(segs):
            end = heads[s + 1] if s + 1 < segs else m
            start[rank[s] + 1] = end - heads[s]
        for j in range(segs):
            start[j + 1] += start[j]
        mask = (1 << shift) - 1
        for s in range(segs):
            end = heads[s + 1] if s + 1 < segs else m
            d = start[rank[s]]
            base = labels[s] << shift
            for t in range(heads[s], end):
                new[d] = base | (coords[t] & mask)
                order[d] = t
                d += 1

    return relabel_sorted
