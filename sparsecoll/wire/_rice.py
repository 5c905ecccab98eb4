"""Rice-coded gaps in three streams: low bits, escapes, unary quotients.

The gaps ``g = i_j − i_{j−1} − 1`` (``i_{−1} = lo − 1``) with parameter k. Streams, each a
whole number of 64-bit words, in this order:

- low: the k low bits of every gap, its ``k & 7`` low bits through
  :func:`~._bits.swar_pack`, then one byte plane per further 8 bits (``k >> 3`` planes of
  m bytes each, each plane a whole number of words);
- escapes: a quotient ``q = g >> k`` of ESC or more in ``W − k`` bits (W: the width of
  ``hi − 1 − lo``), back to back;
- unary: each ``min(q, ESC)`` as that many zero bits then a one.

The low bits are fixed-width, so they encode and decode in vectorised loops; only the unary
stream is walked one gap at a time (by its one bits, not bit by bit).
"""

from __future__ import annotations

import numpy as np

from .._jit import cached_njit
from ._bits import _clz, _ctz, _peek, _put, group_words, nwords, swar_pack, swar_unpack

__all__ = ["ESC", "gap_histogram", "layout", "rice_decode", "rice_encode", "rice_parameter",
           "rice_plan", "rice_scan"]  # fmt: skip

ESC = 32  # unary quotients from here on escape to the escape stream
ONE = np.uint64(1)
Z = np.uint64(0)


def layout(m: int, k: int, nesc: int, ew: int, unary_words: int) -> tuple[int, ...]:
    """Word offsets of the byte planes, escapes and unary stream; the section's words."""
    planes = group_words(m, k & 7) if k & 7 else 0
    esc = planes + (k >> 3) * nwords(8 * m)
    unary = esc + nwords(nesc * ew)
    return planes, esc, unary, unary + unary_words


@cached_njit(nogil=True)
def gap_histogram(idx, lo, step):
    """Histogram of the bit widths of every step-th gap: (counts[65], sums[65])."""
    counts = np.zeros(65, np.int64)
    sums = np.zeros(65, np.float64)
    for j in range(0, idx.shape[0], step):
        prev = np.int64(idx[j - 1]) if j else lo - 1
        g = np.uint64(np.int64(idx[j]) - prev - 1)
        b = 64 - np.int64(_clz(g)) if g else 0
        counts[b] += 1
        sums[b] += float(g)
    return counts, sums


@cached_njit(nogil=True)
def rice_parameter(counts, sums, wbits):
    """The k (0 .. min(W, 58)) whose Rice code of the histogram's gaps is estimated
    shortest."""
    best_k, best = 0, np.inf
    for k in range(min(wbits, 58) + 1):
        bits = 0.0
        for b in range(65):
            c = counts[b]
            if c == 0:
                continue
            if b - 1 - k >= 5:  # (ESC = 32 = 2**5): every quotient of this width escapes
                bits += c * (ESC + 1 + wbits)
            elif b > k:
                bits += c * (k + 1) + sums[b] / 2.0**k
            else:
                bits += c * (k + 1)
        if bits < best:
            best_k, best = k, bits
    return best_k


@cached_njit(nogil=True)
def rice_scan(idx, lo, hi, k):
    """Check ``idx`` is ascending, unique and in [lo, hi); return the sum of min(q, ESC)
    over its gaps and the count of escapes (-1, -1 where the check fails)."""
    m = idx.shape[0]
    first = np.int64(idx[0])
    g = first - lo
    bad = g < 0
    s = min(g >> k, ESC)
    e = np.int64(g >> k >= ESC)
    for j in range(1, m):
        g = np.int64(idx[j]) - np.int64(idx[j - 1]) - 1
        bad |= g < 0
        q = g >> k
        s += min(q, ESC)
        e += np.int64(q >= ESC)
    if bad or np.int64(idx[m - 1]) >= hi:
        return -1, -1
    return s, e


@cached_njit(nogil=True)
def rice_plan(idx, lo, hi, wbits, step):
    """The Rice parameter k chosen from every step-th gap, and :func:`rice_scan` at k:
    (k, sum of min(q, ESC), escapes), the sum -1 where ``idx`` fails the check."""
    k = rice_parameter(*gap_histogram(idx, lo, step), wbits)
    s, e = rice_scan(idx, lo, hi, k)
    return k, s, e


@cached_njit(nogil=True)
def rice_encode(idx, lo, k, ew, tmp, tmp64, words, p0, e0, u0):
    """Write the streams of :func:`layout` into ``words`` (every word of them);
    ``tmp``/``tmp64`` a scratch of ``8 * ceil(m / 8)`` bytes (two views)."""
    m = idx.shape[0]
    r = k & 7
    g0 = np.int64(idx[0]) - lo
    if r:
        rmask = (1 << r) - 1
        tmp[0] = g0 & rmask
        for j in range(1, m):
            tmp[j] = (np.int64(idx[j]) - np.int64(idx[j - 1]) - 1) & rmask
        for j in range(m, tmp.shape[0]):
            tmp[j] = 0
        swar_pack(tmp64, r, words[:p0])
    plane = ((m + 7) >> 3) * 8  # (bytes of a plane: whole words)
    for b in range(k >> 3):
        out = words[p0:e0].view(np.uint8)[b * plane : (b + 1) * plane]
        sh = r + 8 * b
        out[0] = (g0 >> sh) & 255
        for j in range(1, m):
            out[j] = ((np.int64(idx[j]) - np.int64(idx[j - 1]) - 1) >> sh) & 255
        for j in range(m, plane):
            out[j] = 0
    kk, ewu = np.uint64(k), np.uint64(ew)
    esc_q = np.uint64(ESC)
    esc, unary = words[e0:u0], words[u0:]
    ei, eacc, efill = Z, Z, Z
    ui, uacc = Z, Z
    upos = Z
    prev = lo - 1
    for j in range(m):
        v = np.int64(idx[j])
        q = np.uint64(v - prev - 1) >> kk
        prev = v
        if q >= esc_q:
            ei, eacc, efill = _put(esc, ei, eacc, efill, q, ewu)
            q = esc_q
        p = upos + q
        w = p >> np.uint64(6)
        # (q <= ESC < 63: no word is skipped, each holds a one and is stored here)
        uacc = (uacc if w == ui else Z) | (ONE << (p & np.uint64(63)))
        unary[w] = uacc
        ui = w
        upos = p + ONE
    if efill:
        esc[ei] = eacc


@cached_njit(nogil=True)
def rice_decode(words, lo, hi, k, ew, nesc, p0, e0, u0, u1, tmp, tmp64, out):
    """Decode ``out.shape[0]`` gaps from :func:`layout`'s streams (unary in words
    [u0, u1), the array two words longer); False if they do not hold them."""
    m = out.shape[0]
    r = k & 7
    if r:
        swar_unpack(words, r, tmp64)
    if k < 8:  # (k = 0: tmp unread, masked off)
        if nesc == 0:
            return _walk_plain(words, lo, hi, k, u0, u1, tmp, (1 << k) - 1, out)
        return _walk(words, lo, hi, k, ew, nesc, e0, u0, u1, tmp, (1 << k) - 1, out)
    for j in range(m):
        out[j] = tmp[j] if r else 0
    plane = ((m + 7) >> 3) * 8  # (bytes of a plane: whole words)
    for b in range(k >> 3):
        src = words[p0:e0].view(np.uint8)[b * plane : (b + 1) * plane]
        sh = r + 8 * b
        for j in range(m):
            out[j] |= np.int64(src[j]) << sh
    if nesc == 0:
        return _walk_plain(words, lo, hi, k, u0, u1, out, -1, out)
    return _walk(words, lo, hi, k, ew, nesc, e0, u0, u1, out, -1, out)


@cached_njit(inline="always")
def _walk_plain(words, lo, hi, k, u0, u1, lows, mask, out):
    """:func:`_walk` for a stream without escapes: with P_j the position of the j-th one
    bit (the sum of q_i + 1 up to j, less one) and L_j the sum of the low bits up to j,
    ``i_j = lo + j + ((P_j − j) << k) + L_j``."""
    ui = u0
    base = np.int64(0)
    word = words[ui]
    low = np.int64(0)
    v = lo - 1
    for j in range(out.shape[0]):
        while not word:
            ui += 1
            if ui >= u1:
                return False
            word = words[ui]
            base += 64
        p = base + np.int64(_ctz(word))
        word &= word - ONE
        low += np.int64(lows[j]) & mask
        v = lo + j + ((p - j) << k) + low
        out[j] = v
    return v < hi


@cached_njit(inline="always")
def _walk(words, lo, hi, k, ew, nesc, e0, u0, u1, lows, mask, out):
    """Walk the unary stream: gap j is ``(q << k) | (lows[j] & mask)``."""
    e = 0
    epos = np.int64(e0) << 6
    prev = lo - 1
    next_p = np.int64(0)  # (the position after the last one bit)
    ui = u0
    base = np.int64(0)
    word = words[ui]
    for j in range(out.shape[0]):
        while not word:
            ui += 1
            if ui >= u1:
                return False
            word = words[ui]
            base += 64
        p = base + np.int64(_ctz(word))
        word &= word - ONE
        q = p - next_p
        next_p = p + 1
        if q >= ESC:
            if q > ESC or e == nesc:
                return False
            q = np.int64(_peek(words, epos, ew))
            epos += ew
            e += 1
        prev += ((q << k) | (np.int64(lows[j]) & mask)) + 1
        out[j] = prev
    return e == nesc and prev < hi
