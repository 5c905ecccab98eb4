"""An affine permutation of [0, n): π(i) = (a·i + c) mod n, with gcd(a, n) = 1.

The hashed algorithm gives each rank a contiguous range of π-values, so its index set is
π⁻¹ of that range. The multiplier is a/n ≈ frac((seed + 1)·φ) (φ the golden ratio): a
Weyl sequence, whose points i·a/n mod 1 of any run of consecutive i are spread over [0, 1)
with gaps of at most three sizes (the three-distance theorem), so a contiguous hot region
of the index space lands evenly on every range. The inverse is affine too:
π⁻¹(y) = a⁻¹·y + (−a⁻¹·c mod n). Products are formed in uint64 by Horner's rule over
chunks of ``a`` of w = 64 − bits(n − 1) bits (one chunk while n ≤ 2**32), so no
intermediate exceeds 2**64 for any n < 2**63.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from .._array import get_array_module
from .._jit import cached_njit

__all__ = ["AffinePermutation"]

# floor(2**64·(φ − 1)): frac(m·φ) ≈ (m·GOLDEN mod 2**64) / 2**64
GOLDEN = 0x9E3779B97F4A7C15
# floor(2**64·(√2 − 1)), for the offset
SILVER = 0x6A09E667F3BCC908


class AffinePermutation:
    """π(i) = (a·i + c) mod n over [0, n); ``apply`` maps arrays, ``inverse`` undoes it."""

    __slots__ = ("a", "c", "chunks", "n", "width")

    def __init__(self, a: int, c: int, n: int) -> None:
        if n < 1 or not 0 <= c < n or math.gcd(a, n) != 1 or not 0 <= a < max(n, 2):
            raise ValueError(f"not a permutation of [0, {n}): a = {a}, c = {c}")
        self.a, self.c, self.n = int(a), int(c), int(n)
        bits = max(int(n - 1).bit_length(), 1)
        self.width = 64 - bits  # (r mod n)·2**width and chunk·i stay below 2**64
        chunks = []
        rest = self.a
        while True:
            chunks.append(rest & ((1 << self.width) - 1))
            rest >>= self.width
            if not rest:
                break
        self.chunks = np.array(chunks[::-1], dtype=np.uint64)  # most significant first

    @classmethod
    def from_seed(cls, n: int, seed: int = 0) -> AffinePermutation:
        """The permutation of [0, n) for ``seed``: a ≈ n·frac((seed + 1)·φ), made coprime to n."""
        if n <= 2:
            return cls(1 if n == 2 else 0, 0, n)
        a = (((seed + 1) * GOLDEN) % 2**64 * n) >> 64
        a = max(a, 1)
        while math.gcd(a, n) != 1:  # (a run of non-coprimes is short: Jacobsthal's function)
            a = a + 1 if a + 1 < n else 1
        c = ((seed * SILVER) % 2**64 * n) >> 64
        return cls(a, c, n)

    def inverse(self) -> AffinePermutation:
        """The permutation undoing this one."""
        if self.n == 1:
            return AffinePermutation(0, 0, 1)
        a_inv = pow(self.a, -1, self.n)
        return AffinePermutation(a_inv, (-a_inv * self.c) % self.n, self.n)

    def apply(self, x: Any) -> Any:
        """Return π(x) as int64 for an integer array ``x`` of values in [0, n)."""
        xp = get_array_module(x)
        if xp is not np:
            return self._apply_xp(x, xp)
        out = np.empty(x.shape[0], np.int64)
        _kernel()(
            np.ascontiguousarray(x), self.chunks, np.uint64(self.width), np.uint64(self.c),
            np.uint64(self.n), out,
        )  # fmt: skip
        return out

    def _apply_xp(self, x: Any, xp: Any) -> Any:
        """The kernel's arithmetic in whole-array operations (CuPy, and a reference)."""
        v = x.astype(np.uint64)
        n, w = np.uint64(self.n), np.uint64(self.width)
        r = xp.zeros(x.shape[0], np.uint64)
        for chunk in self.chunks:
            r = (r << w) % n
            r = (r + (np.uint64(chunk) * v) % n) % n  # (the sum is below 2n < 2**64)
        r = (r + np.uint64(self.c)) % n
        return r.astype(np.int64)

    def __repr__(self) -> str:
        return f"AffinePermutation(a={self.a}, c={self.c}, n={self.n})"


@functools.cache
def _kernel() -> Any:
    @cached_njit(nogil=True)
    def affine(x, chunks, width, c, n, out):  # pragma: no cover - compiled
        # every operand is uint64: r < n, r·2**width < 2**64, chunk·v < 2**width·n ≤ 2**64
        for t in range(x.shape[0]):
            v = np.uint64(x[t])
            r = np.uint64(0)
            for j in range(chunks.shape[0]):
                r = (r << width) % n
                r += (chunks[j] * v) % n
                if r >= n:
                    r -= n
            r += c
            if r >= n:
                r -= n
            out[t] = np.int64(r)

    return affine
