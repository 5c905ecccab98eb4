"""Which rank owns each index in the hashed algorithm, and where it sits in the owner's range.

[0, n) is cut into blocks of B = 2**shift indices and the blocks into stripes of P. Every
stripe gives one block to every rank: block q of stripe s goes to rank (q + h(s)) mod P, its
index i to the coordinate s·B + (i mod B) in that rank's range [0, L), L = stripes·B. The
rotation h(s) = ⌊P·frac(s·φ + c)⌋ (φ the golden ratio, c from the seed) is a Weyl sequence:
any run of stripes, or of every k-th stripe, rotates evenly. So any set of blocks is spread
within one block per stripe of even, and a rank's coordinates ascend with the indices: an
owner's reduced run, mapped back, is sorted; :meth:`Stripes.gather` interleaves the P runs.
Integer arithmetic only (uint64 wrapping for the hash), the same on every rank and device.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .._array import get_array_module
from .._jit import cached_njit

__all__ = ["GOLDEN", "Stripes"]

GOLDEN = 0x9E3779B97F4A7C15  # floor(2**64·(φ − 1))
SILVER = 0x6A09E667F3BCC908  # floor(2**64·(√2 − 1)), for the seed's offset


class Stripes:
    """The block-to-owner map for ``size`` ranks over [0, n) (see the module docstring)."""

    __slots__ = ("blocks", "length", "n", "offset", "shift", "size")

    def __init__(self, n: int, size: int, shift: int, seed: int = 0) -> None:
        self.n, self.size, self.shift = int(n), int(size), int(shift)
        self.blocks = -(-self.n >> self.shift)
        self.length = -(-self.blocks // self.size) << self.shift  # every owner's range
        self.offset = (seed * SILVER) % 2**64

    def gather(self, runs: list[Any]) -> tuple[Any, Any] | None:
        """Return ``(indices, order)``: every owner's run of coordinates (``runs[j]``, ascending)
        as one ascending array of indices (int64), and where each came from in the runs'
        concatenation. Host arrays only (None otherwise): one walk over the stripes present.
        """
        if not runs or get_array_module(runs[0]) is not np:
            return None
        starts = np.zeros(len(runs) + 1, np.int64)
        starts[1:] = np.cumsum([r.shape[0] for r in runs])
        coords = np.concatenate([r.astype(np.int64, copy=False) for r in runs])
        out = np.empty(coords.shape[0], np.int64)
        order = np.empty(coords.shape[0], np.int64)
        _kernels()[2](coords, starts, *self._args(), out, order)
        return out, order

    def _args(self) -> tuple[Any, ...]:
        return (self.size, self.shift, np.uint64(GOLDEN), np.uint64(self.offset))

    def rotation(self, stripe: Any) -> Any:
        """h(s) for an int64 array of stripes, as int64 in [0, P)."""
        x = stripe.astype(np.uint64) * np.uint64(GOLDEN) + np.uint64(self.offset)
        return (((x >> np.uint64(32)) * np.uint64(self.size)) >> np.uint64(32)).astype(np.int64)

    def locate(self, indices: Any) -> tuple[Any, Any]:
        """Return ``(owner, coordinate)`` (int64 arrays) of each index."""
        if get_array_module(indices) is np:
            owner = np.empty(indices.shape[0], np.int64)
            coords = np.empty(indices.shape[0], np.int64)
            _kernels()[0](np.ascontiguousarray(indices), *self._args(), owner, coords)
            return owner, coords
        i = indices.astype(np.int64)
        block = i >> self.shift
        stripe = block // self.size
        owner = (block - stripe * self.size + self.rotation(stripe)) % self.size
        return owner, (stripe << self.shift) | (i & ((1 << self.shift) - 1))

    def indices(self, coords: Any, owner: int) -> Any:
        """Return the indices (int64) at ``coords`` of ``owner``'s range: :meth:`locate` undone."""
        if get_array_module(coords) is np:
            out = np.empty(coords.shape[0], np.int64)
            _kernels()[1](np.ascontiguousarray(coords), owner, *self._args(), out)
            return out
        y = coords.astype(np.int64)
        stripe = y >> self.shift
        q = (owner - self.rotation(stripe)) % self.size
        block = stripe * self.size + q
        return (block << self.shift) | (y & ((1 << self.shift) - 1))


@functools.cache
def _kernels() -> tuple[Any, Any, Any]:
    # the same integer steps as Stripes.rotation/locate/indices, one pass; the rotation is
    # written out in each kernel (a kernel calling another kernel of this closure would be
    # compiled again in every process: Numba's cache cannot key a closure's dispatcher)

    @cached_njit(nogil=True)
    def locate(indices, size, shift, golden, offset, owner, coords):  # pragma: no cover
        mask = (np.int64(1) << shift) - 1
        for t in range(indices.shape[0]):
            i = np.int64(indices[t])
            block = i >> shift
            stripe = block // size
            x = (np.uint64(stripe) * golden + offset) >> np.uint64(32)
            h = np.int64((x * np.uint64(size)) >> np.uint64(32))
            owner[t] = (block - stripe * size + h) % size
            coords[t] = (stripe << shift) | (i & mask)

    @cached_njit(nogil=True)
    def indices(coords, j, size, shift, golden, offset, out):  # pragma: no cover
        mask = (np.int64(1) << shift) - 1
        for t in range(coords.shape[0]):
            y = np.int64(coords[t])
            stripe = y >> shift
            x = (np.uint64(stripe) * golden + offset) >> np.uint64(32)
            q = (j - np.int64((x * np.uint64(size)) >> np.uint64(32))) % size
            out[t] = ((stripe * size + q) << shift) | (y & mask)

    @cached_njit(nogil=True)
    def gather(coords, starts, size, shift, golden, offset, out, order):  # pragma: no cover
        # stripes in ascending order; in each, blocks q = 0, 1, ... from owner (q + h) mod P;
        # in each block, its owner's entries (ascending): the indices come out ascending
        cur = starts[:-1].copy()
        mask = (np.int64(1) << shift) - 1
        o = 0
        while True:
            low = np.int64(-1)
            for j in range(size):
                if cur[j] < starts[j + 1]:
                    s = coords[cur[j]] >> shift
                    if low < 0 or s < low:
                        low = s
            if low < 0:
                break
            x = (np.uint64(low) * golden + offset) >> np.uint64(32)
            h = np.int64((x * np.uint64(size)) >> np.uint64(32))
            for q in range(size):
                j = (q + h) % size
                base = (low * size + q) << shift
                while cur[j] < starts[j + 1] and (coords[cur[j]] >> shift) == low:
                    out[o] = base | (coords[cur[j]] & mask)
                    order[o] = cur[j]
                    o += 1
                    cur[j] += 1

    return locate, indices, gather
