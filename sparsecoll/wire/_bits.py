"""Bit-stream kernels: the index codes (bit-packed offsets, bitmap, Rice-coded gaps).

Streams are little-endian uint64 words, bit ``b`` of the stream in word ``b >> 6`` at bit
``b & 63``; writers get words with two words of slack past the last bit, readers the
same slack (zeros), so a 64-bit read never leaves the array. Every count, position and shift
is held in int64 or uint64 and never mixed (Numba would widen the mix to float64).

Rice code of the gaps ``g = i_j − i_{j−1} − 1`` (``i_{−1} = lo − 1``) with parameter k: the
quotient ``q = g >> k`` as q zero bits and a one, then the k low bits; a quotient of ESC or
more is ESC zero bits, then g in W bits (the width of ``hi − 1 − lo``).
"""

from __future__ import annotations

import numpy as np

from .._jit import cached_njit

try:  # LLVM's cttz / ctlz (the bit width for 0)
    from numba.cpython.unsafe.numbers import leading_zeros as _clz
    from numba.cpython.unsafe.numbers import trailing_zeros as _ctz
except ImportError:  # pragma: no cover - a Numba without them

    @cached_njit(inline="always")
    def _ctz(x):
        if x == 0:
            return 64
        j = 0
        while not (x >> np.uint64(j)) & np.uint64(1):
            j += 1
        return j

    @cached_njit(inline="always")
    def _clz(x):
        j = 0
        while j < 64 and not (x >> np.uint64(63 - j)) & np.uint64(1):
            j += 1
        return j


__all__ = ["ESC", "SLACK", "_emit", "_peek"]

ESC = 32  # unary quotients from here on escape to the gap in W bits
SLACK = 2  # zero words past a stream's last bit
ONE = np.uint64(1)


@cached_njit(inline="always")
def _peek(w0, w1, off, nb):
    """The nb (<= 64) bits at bit off (< 64) of the words w0, w1 (uint64 each)."""
    v = w0 >> np.uint64(off)
    if off:
        v |= w1 << np.uint64(64 - off)
    if nb < 64:
        v &= (ONE << np.uint64(nb)) - ONE
    return v


@cached_njit(inline="always")
def _emit(acc, fill, val, nb):
    """Append the nb (1..64) low bits of val (< 2**nb) to the pending word acc, of which
    fill bits are used (all uint64). Return (word, acc, fill, full): when full, word is
    complete and goes next in the stream."""
    out = acc | (val << fill)
    fill += nb
    if fill >= 64:
        fill -= np.uint64(64)
        return out, (val >> (nb - fill)) if fill else np.uint64(0), fill, True
    return out, out, fill, False


@cached_njit(nogil=True)
def gap_stats(idx, lo, hi):
    """Check ``idx`` is ascending, unique and in [lo, hi); histogram its gaps' bit widths.

    Returns (counts[65], sums[65]) per width (float64 sums), or a width histogram with
    counts[0] = -1 where the check fails.
    """
    counts = np.zeros(65, np.int64)
    sums = np.zeros(65, np.float64)
    prev = lo - 1
    for j in range(idx.shape[0]):
        v = np.int64(idx[j])
        if v <= prev or v >= hi:
            counts[0] = -1
            return counts, sums
        g = np.uint64(v - prev - 1)
        b = 64 - np.int64(_clz(g)) if g else 0
        counts[b] += 1
        sums[b] += float(g)
        prev = v
    return counts, sums


@cached_njit(nogil=True)
def rice_parameter(counts, sums, wbits):
    """The k (0 .. 58) whose Rice stream is estimated shortest from :func:`gap_stats`'s
    histogram, and that estimate in bits: at most one bit per gap over the exact length
    (the quotients' floors), never under it."""
    best_k, best = 0, np.inf
    for k in range(64 - 5):
        bits = 0.0
        for b in range(65):
            c = counts[b]
            if c == 0:
                continue
            if b - 1 - k >= 5:  # (ESC = 32 = 2**5): every quotient of this width escapes
                bits += c * (ESC + wbits)
            elif b > k:
                bits += c * (k + 1) + sums[b] / 2.0**k
            else:
                bits += c * (k + 1)
        if bits < best:
            best_k, best = k, bits
    return best_k, best


@cached_njit(nogil=True)
def rice_encode(idx, lo, k, wbits, words):
    """Rice-code ``idx``'s gaps into ``words``; return the stream's length in bits."""
    acc, fill, wi = np.uint64(0), np.uint64(0), 0
    prev = lo - 1
    kk, wb, esc = np.uint64(k), np.uint64(wbits), np.uint64(ESC)
    mask = (ONE << kk) - ONE
    small = k <= 64 - ESC  # (a quotient, its stop bit and k bits fit one word)
    for j in range(idx.shape[0]):
        v = np.int64(idx[j])
        g = np.uint64(v - prev - 1)
        prev = v
        q = g >> kk
        if q >= esc:  # ESC zero bits, then the gap
            word, acc, fill, full = _emit(acc, fill, np.uint64(0), esc)
            if full:
                words[wi] = word
                wi += 1
            word, acc, fill, full = _emit(acc, fill, g, wb)
        elif small:
            word, acc, fill, full = _emit(acc, fill, (ONE | ((g & mask) << ONE)) << q, q + ONE + kk)
        else:
            word, acc, fill, full = _emit(acc, fill, ONE << q, q + ONE)
            if full:
                words[wi] = word
                wi += 1
            word, acc, fill, full = _emit(acc, fill, g & mask, kk)
        if full:
            words[wi] = word
            wi += 1
    if fill:
        words[wi] = acc
    return wi * 64 + np.int64(fill)


@cached_njit(nogil=True)
def rice_decode(words, nbits, lo, k, wbits, out):
    """Decode ``out.shape[0]`` Rice-coded gaps into ``out``; False if the stream is short."""
    if k > 64 - ESC - 1:
        return _rice_decode_wide(words, nbits, lo, k, wbits, out)
    kk = np.uint64(k)
    mask = (ONE << kk) - ONE
    need = ESC + 1 + k  # (a code that does not escape fits in this many bits)
    prev = lo - 1
    pos = np.int64(0)
    buf, avail = np.uint64(0), 0  # the stream's bits [pos, pos + avail), low bits first
    for j in range(out.shape[0]):
        if avail < need:
            i = pos >> 6
            buf, avail = _peek(words[i], words[i + 1], pos & 63, 64), 64
        q = np.int64(_ctz(buf))
        if q < ESC:
            g = (np.uint64(q) << kk) | ((buf >> np.uint64(q + 1)) & mask)
            used = q + 1 + k
            buf >>= np.uint64(used)
            avail -= used
            pos += used
        else:
            p = pos + ESC
            i = p >> 6
            g = _peek(words[i], words[i + 1], p & 63, wbits)
            pos = p + wbits
            avail = 0
        if pos > nbits:
            return False
        prev = prev + np.int64(g) + 1
        out[j] = prev
    return True


@cached_njit(nogil=True)
def _rice_decode_wide(words, nbits, lo, k, wbits, out):
    """:func:`rice_decode` for k > 31 (a code may not fit one 64-bit read)."""
    pos = np.int64(0)
    prev = lo - 1
    kk = np.uint64(k)
    for j in range(out.shape[0]):
        i = pos >> 6
        q = np.int64(_ctz(_peek(words[i], words[i + 1], pos & 63, 64)))
        if q >= ESC:
            p = pos + ESC
            i = p >> 6
            g = _peek(words[i], words[i + 1], p & 63, wbits)
            pos = p + wbits
        else:
            p = pos + q + 1
            i = p >> 6
            g = (np.uint64(q) << kk) | _peek(words[i], words[i + 1], p & 63, k)
            pos = p + k
        if pos > nbits:
            return False
        prev = prev + np.int64(g) + 1
        out[j] = prev
    return True


@cached_njit(nogil=True)
def pack_encode(idx, lo, wbits, words):
    """Write each ``idx − lo`` in wbits bits."""
    acc, fill, wi = np.uint64(0), np.uint64(0), 0
    wb = np.uint64(wbits)
    for j in range(idx.shape[0]):
        word, acc, fill, full = _emit(acc, fill, np.uint64(np.int64(idx[j]) - lo), wb)
        if full:
            words[wi] = word
            wi += 1
    if fill:
        words[wi] = acc


@cached_njit(nogil=True)
def pack_decode(words, lo, wbits, out):
    """Read ``out.shape[0]`` offsets of wbits bits, adding lo."""
    pos = np.int64(0)
    for j in range(out.shape[0]):
        i = pos >> 6
        out[j] = lo + np.int64(_peek(words[i], words[i + 1], pos & 63, wbits))
        pos += wbits


@cached_njit(nogil=True)
def bitmap_encode(idx, first, words):
    """Set bit ``i − first`` for each i of ``idx``."""
    for j in range(idx.shape[0]):
        p = np.int64(idx[j]) - first
        words[p >> 6] |= ONE << np.uint64(p & 63)


@cached_njit(nogil=True)
def bitmap_decode(words, first, out):
    """Write the positions of the set bits (plus first) into ``out``; return how many."""
    j = 0
    m = out.shape[0]
    for w in range(words.shape[0]):
        word = words[w]
        while word:
            if j == m:
                return j + 1
            out[j] = first + (w << 6) + np.int64(_ctz(word))
            word &= word - ONE
            j += 1
    return j
