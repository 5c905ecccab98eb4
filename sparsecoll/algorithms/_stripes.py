"""Which rank owns each index in the hashed algorithm, and where it sits in the owner's range.

[0, n) is cut into blocks of B = 2**shift indices and the blocks into stripes of P. Every
stripe gives one block to every rank: block q of stripe s goes to rank (q + h(s)) mod P, its
index i to the coordinate s·B + (i mod B) in that rank's range [0, L), L = stripes·B. The
rotation h(s) = ⌊P·frac(s·φ + c)⌋ (φ the golden ratio, c from the seed) is a Weyl sequence:
any run of stripes, or of every k-th stripe, rotates evenly. So any set of blocks is spread
within one block per stripe of even, and a rank's coordinates ascend with the indices: an
owner's reduced run, mapped back, is sorted, and the result is a merge of P runs.
Integer arithmetic only (uint64 wrapping for the hash), the same on every rank and device.
"""

from __future__ import annotations

from typing import Any

import numpy as np

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

    def rotation(self, stripe: Any) -> Any:
        """h(s) for an int64 array of stripes, as int64 in [0, P)."""
        x = stripe.astype(np.uint64) * np.uint64(GOLDEN) + np.uint64(self.offset)
        return (((x >> np.uint64(32)) * np.uint64(self.size)) >> np.uint64(32)).astype(np.int64)

    def locate(self, indices: Any) -> tuple[Any, Any]:
        """Return ``(owner, coordinate)`` (int64 arrays) of each index."""
        i = indices.astype(np.int64)
        block = i >> self.shift
        stripe = block // self.size
        owner = (block - stripe * self.size + self.rotation(stripe)) % self.size
        return owner, (stripe << self.shift) | (i & ((1 << self.shift) - 1))

    def indices(self, coords: Any, owner: int) -> Any:
        """Return the indices (int64) at ``coords`` of ``owner``'s range: :meth:`locate` undone."""
        y = coords.astype(np.int64)
        stripe = y >> self.shift
        q = (owner - self.rotation(stripe)) % self.size
        block = stripe * self.size + q
        return (block << self.shift) | (y & ((1 << self.shift) - 1))
