"""Value kernels: IEEE values split into sign, exponent offset and mantissa, bit-packed.

Each value (its unsigned-integer view ``u``) becomes one field of ``1 + w + mbits`` bits:
the sign, the biased exponent minus the message's smallest (in w bits), the mantissa bits
as they are. Every bit of ``u`` is kept, so NaN payloads, infinities, −0.0 and subnormals
come back as they went.
"""

from __future__ import annotations

import numpy as np

from .._jit import cached_njit
from ._bits import _peek, _put

__all__ = ["FLOATS", "exponent_range", "split_decode", "split_encode"]

# dtype: (unsigned view, exponent bits, mantissa bits)
FLOATS = {
    np.dtype(np.float16): (np.uint16, 5, 10),
    np.dtype(np.float32): (np.uint32, 8, 23),
    np.dtype(np.float64): (np.uint64, 11, 52),
}


@cached_njit(nogil=True)
def exponent_range(u, mbits, ebits):
    """Smallest and largest biased exponent in ``u`` (0, 0 when empty)."""
    if u.shape[0] == 0:
        return 0, 0
    emask = (np.uint64(1) << np.uint64(ebits)) - np.uint64(1)
    sh = np.uint64(mbits)
    lo = np.int64(emask)
    hi = np.int64(0)
    for j in range(u.shape[0]):
        e = np.int64((np.uint64(u[j]) >> sh) & emask)
        lo = min(lo, e)
        hi = max(hi, e)
    return lo, hi


@cached_njit(nogil=True)
def split_encode(u, mbits, ebits, emin, w, words):
    """Write each value as sign | exponent − emin (w bits) | mantissa."""
    sh = np.uint64(mbits)
    emask = (np.uint64(1) << np.uint64(ebits)) - np.uint64(1)
    mmask = (np.uint64(1) << sh) - np.uint64(1)
    top = np.uint64(w + mbits)
    sbit = np.uint64(ebits + mbits)
    nb = np.uint64(1 + w + mbits)
    base = np.uint64(emin)
    wi, acc, fill = 0, np.uint64(0), np.uint64(0)
    for j in range(u.shape[0]):
        x = np.uint64(u[j])
        e = ((x >> sh) & emask) - base
        f = ((x >> sbit) << top) | (e << sh) | (x & mmask)
        wi, acc, fill = _put(words, wi, acc, fill, f, nb)
    if fill:
        words[wi] = acc


@cached_njit(nogil=True)
def split_decode(words, mbits, ebits, emin, w, out):
    """Inverse of :func:`split_encode` into the unsigned view ``out``."""
    sh = np.uint64(mbits)
    wmask = (np.uint64(1) << np.uint64(w)) - np.uint64(1)
    mmask = (np.uint64(1) << sh) - np.uint64(1)
    top = np.uint64(w + mbits)
    nb = 1 + w + mbits
    base = np.uint64(emin)
    sbit = np.uint64(ebits + mbits)
    for j in range(out.shape[0]):
        f = _peek(words, np.int64(j) * nb, nb)
        e = ((f >> sh) & wmask) + base
        out[j] = ((f >> top) << sbit) | (e << sh) | (f & mmask)
