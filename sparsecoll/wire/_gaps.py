"""Gaps in a fixed width b, the few wider ones patched from an exception list.

The gaps ``g_j = i_j − i_{j−1} − 1`` (``i_{−1} = lo − 1``) travel in two streams, each a
whole number of 64-bit words, in this order:

- low: the b low bits of every gap, its ``b & 7`` low bits through
  :func:`~._bits.swar_pack`, then one byte plane per further 8 bits (``b >> 3`` planes of
  m bytes each, each plane a whole number of words);
- exceptions: for each gap with ``g >> b`` nonzero, its position j in P bits (P: the width
  of m − 1) and ``g >> b`` in ``W − b`` bits (W: the width of ``hi − 1 − lo``), back to back.

Every stream is fixed-width: encoding is a few passes that vectorise (the first also marks
each exception with a bit, so the exceptions are found by those bits, not by a scan), and
decoding is the same passes, a patch per exception and a running sum. b is chosen from a
sample of the gaps' widths: the b that minimises b plus the share of wider gaps times an
exception's P + W − b bits (at 1% density, b = 9 and about 9.2 bits a gap).
"""

from __future__ import annotations

import numpy as np

from .._jit import cached_njit
from ._bits import _clz, _ctz, _peek, _popcount, _put, group_words, nwords, swar_pack, swar_unpack

__all__ = ["gap_plan", "gaps_decode", "gaps_encode", "layout", "marks_words"]

Z = np.uint64(0)
ONE = np.uint64(1)


@cached_njit(inline="always")
def layout(m, b, nesc, pbits, hbits):
    """Word offsets of the byte planes and the exceptions; the section's words."""
    planes = group_words(m, b & 7) if b & 7 else 0
    exc = planes + (b >> 3) * nwords(8 * m)
    return planes, exc, exc + nwords(nesc * (pbits + hbits))


@cached_njit(nogil=True)
def _width_choice(idx, lo, step, wbits, pbits):
    """The b (0 .. W) estimated best from every step-th gap's bit width."""
    counts = np.zeros(65, np.int64)
    for j in range(0, idx.shape[0], step):
        prev = np.int64(idx[j - 1]) if j else lo - 1
        g = np.uint64(np.int64(idx[j]) - prev - 1)
        counts[64 - np.int64(_clz(g)) if g else 0] += 1
    best_b, best = 0, np.inf
    wider = np.int64(idx.shape[0] - 1) // step + 1  # (samples wider than b, b = −1)
    for b in range(wbits + 1):
        wider -= counts[b]
        bits = b + wider * (pbits + wbits - b) / ((idx.shape[0] - 1) // step + 1)
        if bits < best:
            best_b, best = b, bits
    return best_b


@cached_njit(nogil=True)
def gap_plan(idx, lo, hi, wbits, pbits, step, tmp, marks):
    """Choose b from every step-th gap; check ``idx`` is ascending, unique and in
    [lo, hi); write each gap's ``b & 7`` low bits into ``tmp`` (zeros to its end) and the
    exceptions among gaps 1 .. m − 1 as one bits in ``marks`` (gap j at bit j − 1, a
    uint64 per 64 gaps). Returns (b, exceptions), the count -1 where the check fails."""
    b = _width_choice(idx, lo, step, wbits, pbits)
    m = idx.shape[0]
    rmask = (1 << (b & 7)) - 1
    g = np.int64(idx[0]) - lo
    bad = g < 0
    tmp[0] = g & rmask
    for blk in range(marks.shape[0]):
        base = 1 + blk * 64
        mk = Z
        if base + 64 <= m:  # (a whole block: a loop that vectorises)
            for t in range(64):
                g = np.int64(idx[base + t]) - np.int64(idx[base + t - 1]) - 1
                bad |= g < 0
                mk |= np.uint64(g >> b != 0) << np.uint64(t)
                tmp[base + t] = g & rmask
        else:
            for t in range(m - base):
                g = np.int64(idx[base + t]) - np.int64(idx[base + t - 1]) - 1
                bad |= g < 0
                mk |= np.uint64(g >> b != 0) << np.uint64(t)
                tmp[base + t] = g & rmask
        marks[blk] = mk
    for j in range(m, tmp.shape[0]):
        tmp[j] = 0
    if bad or np.int64(idx[m - 1]) >= hi:
        return b, -1
    e = np.int64((np.int64(idx[0]) - lo) >> b != 0)
    for blk in range(marks.shape[0]):
        e += np.int64(_popcount(marks[blk]))
    return b, e


def marks_words(m: int) -> int:
    """Words of :func:`gap_plan`'s exception marks for m gaps."""
    return (m + 62) >> 6


@cached_njit(nogil=True)
def gaps_encode(idx, lo, b, pbits, hbits, tmp64, marks, words, p0, e0):
    """Write the streams of :func:`layout` into ``words`` (every word of them), from the
    low bits and marks :func:`gap_plan` left in ``tmp64`` and ``marks``."""
    m = idx.shape[0]
    r = b & 7
    if r:
        swar_pack(tmp64, r, words[:p0])
    g0 = np.int64(idx[0]) - lo
    plane = ((m + 7) >> 3) * 8  # (bytes of a plane: whole words)
    for k in range(b >> 3):
        out = words[p0:e0].view(np.uint8)[k * plane : (k + 1) * plane]
        sh = r + 8 * k
        out[0] = (g0 >> sh) & 255
        for j in range(1, m):
            out[j] = ((np.int64(idx[j]) - np.int64(idx[j - 1]) - 1) >> sh) & 255
        for j in range(m, plane):
            out[j] = 0
    exc = words[e0:]
    if exc.shape[0] == 0:
        return
    pb, hb = np.uint64(pbits), np.uint64(hbits)
    wi, acc, fill = Z, Z, Z
    if g0 >> b:
        wi, acc, fill = _put(exc, wi, acc, fill, Z, pb)
        wi, acc, fill = _put(exc, wi, acc, fill, np.uint64(g0 >> b), hb)
    for blk in range(marks.shape[0]):
        mk = marks[blk]
        while mk:
            j = 1 + blk * 64 + np.int64(_ctz(mk))
            mk &= mk - ONE
            h = (np.int64(idx[j]) - np.int64(idx[j - 1]) - 1) >> b
            wi, acc, fill = _put(exc, wi, acc, fill, np.uint64(j), pb)
            wi, acc, fill = _put(exc, wi, acc, fill, np.uint64(h), hb)
    if fill:
        exc[wi] = acc


@cached_njit(nogil=True)
def gaps_decode(words, lo, hi, b, pbits, hbits, nesc, p0, e0, tmp, tmp64, out):
    """Decode ``out.shape[0]`` indices from :func:`layout`'s streams (the array two words
    longer than them); False if the exceptions or the indices do not fit."""
    m = out.shape[0]
    r = b & 7
    if r:
        swar_unpack(words[:p0], r, tmp64)
    else:
        tmp[:m] = 0
    plane = ((m + 7) >> 3) * 8
    if b < 8:
        for j in range(m):
            out[j] = tmp[j]
    for k in range(b >> 3):  # (the first plane joins the low bits in one pass)
        src = words[p0:e0].view(np.uint8)[k * plane : (k + 1) * plane]
        sh = r + 8 * k
        if k == 0:
            for j in range(m):
                out[j] = np.int64(tmp[j]) | (np.int64(src[j]) << sh)
        else:
            for j in range(m):
                out[j] |= np.int64(src[j]) << sh
    pos = np.int64(e0) << 6
    last = -1
    for _ in range(nesc):
        j = np.int64(_peek(words, pos, pbits))
        h = np.int64(_peek(words, pos + pbits, hbits))
        pos += pbits + hbits
        if j <= last or j >= m or h == 0:
            return False
        out[j] = np.int64(out[j]) | (h << b)
        last = j
    v = lo - 1
    if hbits + b + 64 - np.int64(_clz(np.uint64(m))) < 62 and lo < (1 << 62):  # (no overflow)
        return _running_sum(out, v) < hi
    for j in range(m):
        v += np.int64(out[j]) + 1
        if v >= hi:
            return False
        out[j] = v
    return True


@cached_njit(inline="always")
def _running_sum(out, v):
    """``out[j] = v + sum(out[:j + 1]) + j + 1`` (the indices from the gaps); the last.
    Four quarters run side by side, each started from the sums before it."""
    m = out.shape[0]
    q = m >> 2
    s1 = s2 = s3 = np.int64(0)
    for j in range(q):
        s1 += np.int64(out[j])
        s2 += np.int64(out[q + j])
        s3 += np.int64(out[2 * q + j])
    v0 = v
    v1 = v0 + s1 + q
    v2 = v1 + s2 + q
    v3 = v2 + s3 + q
    for j in range(q):
        v0 += np.int64(out[j]) + 1
        v1 += np.int64(out[q + j]) + 1
        v2 += np.int64(out[2 * q + j]) + 1
        v3 += np.int64(out[3 * q + j]) + 1
        out[j] = v0
        out[q + j] = v1
        out[2 * q + j] = v2
        out[3 * q + j] = v3
    for j in range(4 * q, m):
        v3 += np.int64(out[j]) + 1
        out[j] = v3
    return v3
