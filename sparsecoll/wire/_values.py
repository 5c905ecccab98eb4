"""Value kernels: IEEE values split into a sign-and-mantissa field and an exponent offset.

Each value (its unsigned-integer view ``x``) becomes two fields: A, the sign above the
mantissa bits (``1 + mbits`` bits), and B, the biased exponent minus the message's
smallest (w bits). Every bit of ``x`` is kept, so NaN payloads, infinities, −0.0 and
subnormals come back as they went. A field of nb bits travels as its ``nb & 7`` low bits
through :func:`~._bits.swar_pack`, then one byte plane per further 8 bits: streams of
fixed width, written and read in loops that vectorise (float32: three byte planes for A,
w bits for B). :func:`layout` gives the streams' places.
"""

from __future__ import annotations

import numpy as np

from .._jit import cached_njit
from ._bits import group_words, nwords, swar_pack, swar_unpack

__all__ = ["FLOATS", "exponent_range", "layout", "split_decode", "split_encode"]

# dtype: (unsigned view, exponent bits, mantissa bits)
FLOATS = {
    np.dtype(np.float16): (np.uint16, 5, 10),
    np.dtype(np.float32): (np.uint32, 8, 23),
    np.dtype(np.float64): (np.uint64, 11, 52),
}
ONE = np.uint64(1)


@cached_njit(nogil=True)
def exponent_range(u, mbits, ebits):
    """Smallest and largest biased exponent in ``u`` (0, 0 when empty)."""
    if u.shape[0] == 0:
        return 0, 0
    if mbits == 23:  # float32: 32-bit lanes, twice as many to a vector
        lo32, hi32 = np.uint32(255), np.uint32(0)
        for j in range(u.shape[0]):
            e = (np.uint32(u[j]) >> np.uint32(23)) & np.uint32(255)
            lo32 = min(lo32, e)
            hi32 = max(hi32, e)
        return np.int64(lo32), np.int64(hi32)
    emask = (np.uint64(1) << np.uint64(ebits)) - np.uint64(1)
    sh = np.uint64(mbits)
    lo = np.int64(emask)
    hi = np.int64(0)
    for j in range(u.shape[0]):
        e = np.int64((np.uint64(u[j]) >> sh) & emask)
        lo = min(lo, e)
        hi = max(hi, e)
    return lo, hi


@cached_njit(inline="always")
def layout(cnt, mbits, w):
    """Words before the last stream, and the bytes of that last stream (a message ends
    with it, cut to whole bytes)."""
    groups, plane = (cnt + 7) >> 3, nwords(8 * cnt)
    words, last = 0, 0
    for f in range(2):
        nb = 1 + mbits if f == 0 else w
        if nb & 7:
            words, last = words + nwords(8 * last), groups * (nb & 7)
        if nb >> 3:
            words, last = words + nwords(8 * last) + plane * ((nb >> 3) - 1), cnt
    return words, last


@cached_njit(inline="always")
def _field_a(x, mbits, sbit):
    return (x & ((ONE << mbits) - ONE)) | ((x >> sbit) << mbits)


@cached_njit(inline="always")
def _field_b(x, mbits, emask, base):
    return ((x >> mbits) & emask) - base


@cached_njit(nogil=True)
def split_encode(u, mbits, ebits, emin, w, tmp, tmp64, words):
    """Write the streams of fields A then B of each value of ``u`` into ``words`` (every
    word of them); ``tmp``/``tmp64`` a scratch of ``8 * ceil(cnt / 8)`` bytes."""
    cnt = u.shape[0]
    mb, sbit = np.uint64(mbits), np.uint64(mbits + ebits)
    emask = (ONE << np.uint64(ebits)) - ONE
    base = np.uint64(emin)
    plane = ((cnt + 7) >> 3) * 8
    if mbits == 23 and 0 < w < 8:  # float32: A in three planes, B in w bits, one pass
        p = plane >> 3
        d0 = words[:p].view(np.uint8)
        d1 = words[p : 2 * p].view(np.uint8)
        d2 = words[2 * p : 3 * p].view(np.uint8)
        b32, c7, c8, m8 = np.uint32(emin), np.uint32(127), np.uint32(8), np.uint32(255)
        for j in range(cnt):  # (in 32-bit lanes: A's top byte is the sign over 7 bits)
            x = np.uint32(u[j])
            d0[j] = np.uint8(x & m8)
            d1[j] = np.uint8((x >> c8) & m8)
            d2[j] = np.uint8(((x >> np.uint32(16)) & c7) | ((x >> np.uint32(24)) & np.uint32(128)))
            tmp[j] = np.uint8(((x >> np.uint32(23)) & m8) - b32)
        for j in range(cnt, plane):
            d0[j] = d1[j] = d2[j] = tmp[j] = 0
        swar_pack(tmp64, w, words[3 * p :])
        return
    if mbits == 52 and 0 < w < 8:  # float64: A's 5 low bits, its six planes, one pass
        p, ga = plane >> 3, group_words(cnt, 5)
        dp = words[ga : ga + 6 * p].view(np.uint8)
        for j in range(cnt):
            a = _field_a(np.uint64(u[j]), mb, sbit)
            tmp[j] = a & np.uint64(31)
            for k in range(6):
                dp[k * plane + j] = (a >> np.uint64(5 + 8 * k)) & np.uint64(255)
        for j in range(cnt, plane):
            tmp[j] = 0
            for k in range(6):
                dp[k * plane + j] = 0
        swar_pack(tmp64, 5, words[:ga])
        for j in range(cnt):
            tmp[j] = _field_b(np.uint64(u[j]), mb, emask, base)
        swar_pack(tmp64, w, words[ga + 6 * p :])
        return
    off = 0
    for f in range(2):
        nb = 1 + mbits if f == 0 else w
        r = nb & 7
        if r:
            rmask = (ONE << np.uint64(r)) - ONE
            if f == 0:
                for j in range(cnt):
                    tmp[j] = _field_a(np.uint64(u[j]), mb, sbit) & rmask
            else:
                for j in range(cnt):
                    tmp[j] = _field_b(np.uint64(u[j]), mb, emask, base) & rmask
            for j in range(cnt, plane):
                tmp[j] = 0
            gw = group_words(cnt, r)
            swar_pack(tmp64, r, words[off : off + gw])
            off += gw
        for b in range(nb >> 3):
            dst = words[off : off + (plane >> 3)].view(np.uint8)
            sh = np.uint64(r + 8 * b)
            if f == 0:
                for j in range(cnt):
                    dst[j] = (_field_a(np.uint64(u[j]), mb, sbit) >> sh) & np.uint64(255)
            else:
                for j in range(cnt):
                    dst[j] = (_field_b(np.uint64(u[j]), mb, emask, base) >> sh) & np.uint64(255)
            for j in range(cnt, plane):
                dst[j] = 0
            off += plane >> 3


@cached_njit(nogil=True)
def _read_field(words, off, nb, cnt, tmp, tmp64, out):
    """Read a field of nb bits of ``cnt`` values at word off into ``out``; its words."""
    r = nb & 7
    plane = ((cnt + 7) >> 3) * 8
    start = off
    if r:
        swar_unpack(words[off:], r, tmp64)
        for j in range(cnt):
            out[j] = tmp[j]
        off += group_words(cnt, r)
    else:
        for j in range(cnt):
            out[j] = 0
    for b in range(nb >> 3):
        src = words[off : off + (plane >> 3)].view(np.uint8)
        sh = np.uint64(r + 8 * b)
        for j in range(cnt):
            out[j] |= np.uint64(src[j]) << sh
        off += plane >> 3
    return off - start


@cached_njit(nogil=True)
def split_decode(words, mbits, ebits, emin, w, tmp, tmp64, out, scratch):
    """Inverse of :func:`split_encode` into the unsigned view ``out``; ``scratch`` a uint16
    array of its length (field B; unused for float32)."""
    cnt = out.shape[0]
    mb, sbit = np.uint64(mbits), np.uint64(mbits + ebits)
    mmask = (ONE << mb) - ONE
    base = np.uint64(emin)
    if mbits == 23 and 0 < w < 8:  # float32: the layout of split_encode's fast path
        p = (((cnt + 7) >> 3) * 8) >> 3
        s0 = words[:p].view(np.uint8)
        s1 = words[p : 2 * p].view(np.uint8)
        s2 = words[2 * p : 3 * p].view(np.uint8)
        swar_unpack(words[3 * p :], w, tmp64)
        b32, c7 = np.uint32(emin), np.uint32(127)
        for j in range(cnt):
            a2 = np.uint32(s2[j])
            a = np.uint32(s0[j]) | (np.uint32(s1[j]) << np.uint32(8)) | ((a2 & c7) << np.uint32(16))
            e = (np.uint32(tmp[j]) + b32) << np.uint32(23)
            out[j] = a | e | ((a2 >> np.uint32(7)) << np.uint32(31))
        return
    if mbits == 52 and 0 < w < 8:  # float64: the layout of split_encode's fast path
        plane = ((cnt + 7) >> 3) * 8
        p, ga = plane >> 3, group_words(cnt, 5)
        sp = words[ga : ga + 6 * p].view(np.uint8)
        tb = np.empty(plane, np.uint8)  # (field B's bytes, beside A's low bits in tmp)
        swar_unpack(words[ga + 6 * p :], w, tb.view(np.uint64))
        swar_unpack(words[:ga], 5, tmp64)
        for j in range(cnt):
            a = np.uint64(tmp[j])
            for k in range(6):
                a |= np.uint64(sp[k * plane + j]) << np.uint64(5 + 8 * k)
            e = np.uint64(tb[j]) + base
            out[j] = ((a >> mb) << sbit) | (e << mb) | (a & mmask)
        return
    off = _read_field(words, 0, 1 + mbits, cnt, tmp, tmp64, out)
    if w:
        _read_field(words, off, w, cnt, tmp, tmp64, scratch)
        for j in range(cnt):
            a = np.uint64(out[j])
            e = np.uint64(scratch[j]) + base
            out[j] = ((a >> mb) << sbit) | (e << mb) | (a & mmask)
    else:
        for j in range(cnt):
            a = np.uint64(out[j])
            out[j] = ((a >> mb) << sbit) | (base << mb) | (a & mmask)
