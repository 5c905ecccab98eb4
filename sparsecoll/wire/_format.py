"""The message layout: header, index section, value section; the smallest format is chosen.

Header: one tag byte (index format in the low nibble, value format in the high one), the
pair count m as a LEB128 varint, then the index format's parameters, then the value
format's, then zero bytes to a multiple of 8. Index formats, each a whole number of 64-bit
words: RAW (m indices of the index dtype), PACKED (``i − lo`` in W = bits(hi − 1 − lo)
bits each), BITMAP (varints ``first − lo`` and ``span``, then span bits over
[first, first + span)), GAPS (a byte b and a varint for the exceptions' count, then the
streams of :mod:`._gaps`). Value formats, the last section, a whole number of bytes: RAW
(the values' bytes) and SPLIT (varint emin, byte w, then the fields of :mod:`._values`).
The sizes follow from the header, so the format is chosen from exact sizes without a trial
encode, and the kernels write the message in place.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._jit import cached_njit
from . import _bits, _gaps, _values

__all__ = ["decode_pairs", "encode_pairs", "encoded_size", "padded"]

I_RAW, I_PACKED, I_BITMAP, I_GAPS = 0, 1, 2, 3
V_RAW, V_SPLIT = 0, 1
INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
SAMPLE = 1024  # gaps sampled to choose the gaps' width
HEAD = 48  # bytes a header takes at most (a tag byte, six varints, two bytes)
IN_PLACE = 4096  # bytes from which a message is read where it lies (a copy of fewer is quicker)
SPARE = 8 * _bits.SLACK  # bytes the kernels may read past a message's end (bits unused)


def _scratch(m: int, after: np.ndarray | None = None) -> np.ndarray:
    """Bytes for m small fields, whole words; past 64 KiB, with ``after``, starting half a
    page (mod 4096) past where that array ends. The gaps' first pass reads the indices
    while it writes these bytes, and runs several times slower when they begin just past
    the indices' end mod 4096, where an allocation made after the indices tends to land
    (docs/reports/wire.md)."""
    size = ((m + 7) >> 3) * 8
    if after is None or size < 65536:
        return np.empty(size, np.uint8)
    raw = np.empty(size + 4096, np.uint8)
    end = after.ctypes.data + after.nbytes
    off = (end + 2048 - raw.ctypes.data) % 4096 & ~63  # (whole cache lines)
    return raw[off : off + size]


def _width(span: int) -> int:
    return max(1, int(span).bit_length())


@cached_njit(inline="always")
def _varint_len(v):
    n = 1
    while v >= 128:
        v >>= 7
        n += 1
    return n


@cached_njit(inline="always")
def _put_varint(out, pos, v):
    while v >= 128:
        out[pos] = (v & 127) | 128
        v >>= 7
        pos += 1
    out[pos] = v
    return pos + 1


@cached_njit(nogil=True)
def _plan(idx, u, lo, hi, wbits, pbits, ebits, mbits, step, tmp, marks):
    """The smallest formats of a message and its sizes, in one compiled call: the gaps'
    first pass (:func:`~._gaps.gap_plan`, which checks the indices), the exponents' range,
    each index format's words and the value formats' bytes. Returns (index format, value
    format, b, exceptions, emin, w, header bytes, index words, value bytes, gap plane
    offset, exceptions offset, message bytes); the index format -1 where the indices fail
    the check."""
    m = idx.shape[0]
    b, nesc = _gaps.gap_plan(idx, lo, hi, wbits, pbits, step, tmp, marks)
    if nesc < 0:
        return -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
    first = np.int64(idx[0])
    span = np.int64(idx[m - 1]) - first + 1
    fmt, iw = I_RAW, _bits.nwords(m * idx.itemsize * 8)  # (ties: the simpler decode)
    if _bits.nwords(m * wbits) < iw:
        fmt, iw = I_PACKED, _bits.nwords(m * wbits)
    if _bits.nwords(span) < iw:
        fmt, iw = I_BITMAP, _bits.nwords(span)
    l0, l1, l2 = _gaps.layout(m, b, nesc, pbits, wbits - b)
    if l2 < iw:
        fmt, iw = I_GAPS, l2
    lo_e, hi_e = _values.exponent_range(u, mbits, ebits)
    w = 64 - np.int64(_bits._clz(np.uint64(hi_e - lo_e))) if hi_e > lo_e else 0
    cnt = u.shape[0]
    vfmt, vbytes = V_RAW, u.nbytes
    if w < ebits:
        before, last = _values.layout(cnt, mbits, w)
        if before * 8 + last < u.nbytes:  # (a few values: the planes' padding outweighs)
            vfmt, vbytes = V_SPLIT, before * 8 + last
    head = 1 + _varint_len(m)
    if fmt == I_BITMAP:
        head += _varint_len(first - lo) + _varint_len(span)
    elif fmt == I_GAPS:
        head += 1 + _varint_len(nesc)
    if vfmt == V_SPLIT:
        head += _varint_len(lo_e) + 1
    size = _bits.nwords(head * 8) * 8 + iw * 8 + vbytes
    return fmt, vfmt, b, nesc, lo_e, w, head, iw, vbytes, l0, l1, size


@cached_njit(nogil=True)
def _write(words, idx, u, lo, wbits, pbits, ebits, mbits, plan, tmp, tmp64, marks):
    """Write the message :func:`_plan` laid out into ``words``: the header, zeros to a
    whole word, the index section, the value section."""
    fmt, vfmt, b, nesc, emin, w, head, iw, vbytes, p0, e0 = plan[:11]
    m = idx.shape[0]
    out = words.view(np.uint8)
    first = np.int64(idx[0])
    out[0] = fmt | (vfmt << 4)  # (the tag byte)
    pos = _put_varint(out, 1, np.int64(m))
    if fmt == I_BITMAP:
        pos = _put_varint(out, pos, first - lo)
        pos = _put_varint(out, pos, np.int64(idx[m - 1]) - first + 1)
    elif fmt == I_GAPS:
        out[pos] = b
        pos = _put_varint(out, pos + 1, nesc)
    if vfmt == V_SPLIT:
        pos = _put_varint(out, pos, emin)
        out[pos] = w
        pos += 1
    hw = _bits.nwords(head * 8)
    for j in range(pos, hw * 8):
        out[j] = 0
    sec = words[hw : hw + iw]
    if fmt == I_RAW:
        raw = sec.view(np.uint8)
        src = idx.view(np.uint8)
        for j in range(src.shape[0]):
            raw[j] = src[j]
        for j in range(src.shape[0], raw.shape[0]):
            raw[j] = 0
    elif fmt == I_PACKED:
        _bits.pack_encode(idx, lo, wbits, sec)
    elif fmt == I_BITMAP:
        _bits.bitmap_encode(idx, first, sec)
    else:
        low = tmp64[: (m + 7) >> 3]  # (the gaps' low bits: m bytes, whole words)
        _gaps.gaps_encode(idx, lo, b, pbits, wbits - b, low, marks, sec, p0, e0)
    if vfmt == V_RAW:
        src = u.view(np.uint8)
        at = (hw + iw) * 8
        for j in range(vbytes):
            out[at + j] = src[j]
    else:
        _values.split_encode(u, mbits, ebits, emin, w, tmp, tmp64, words[hw + iw :])


def encode_pairs(indices: Any, values: Any, lo: int, hi: int) -> np.ndarray:
    """Encode sorted unique ``indices`` in [lo, hi) and their ``values`` losslessly.

    Args:
        indices: 1-D int32 or int64 host array, ascending, unique, in [lo, hi).
        values: float16/32/64 host array of shape (m,) or (m, D) (rows: the decoder is
            told D).
        lo, hi: the range both sides know the indices lie in.

    Returns:
        A uint8 array: the message :func:`decode_pairs` reads, a view into zero bytes to a
        multiple of 8 and two words more (:func:`padded`; a decoder reads such a message
        where it lies).
    """
    idx = np.ascontiguousarray(indices)
    vals = np.ascontiguousarray(values)
    if idx.ndim != 1 or idx.dtype not in INDEX_DTYPES:
        raise TypeError(f"indices must be a 1-D int32 or int64 array, got {idx.dtype} {idx.shape}")
    if vals.dtype not in _values.FLOATS or vals.ndim not in (1, 2):
        raise TypeError(f"values must be float16/32/64 of 1 or 2 dimensions, got {vals.dtype}")
    m = idx.shape[0]
    if vals.shape[0] != m:
        raise ValueError(f"expecting {m} values (rows), got {vals.shape[0]}")
    if not 0 <= lo <= hi:
        raise ValueError(f"expecting 0 <= lo <= hi, got lo={lo}, hi={hi}")
    if m == 0:
        return np.zeros(2, np.uint8)  # (a tag byte, m = 0)
    lo, hi = int(lo), int(hi)
    wbits, pbits = _width(hi - 1 - lo), int(_pbits(m))
    utype, ebits, mbits = _values.FLOATS[vals.dtype]
    u = vals.reshape(-1).view(utype)
    tmp = _scratch(max(m, u.shape[0]), idx)
    marks = np.empty(_gaps.marks_words(m), np.uint64)
    step = max(1, m // SAMPLE)
    plan = _plan(idx, u, lo, hi, wbits, pbits, ebits, mbits, step, tmp, marks)
    if plan[0] < 0:
        raise ValueError(f"indices must be ascending, unique and in [{lo}, {hi})")
    size = plan[11]
    words = np.empty(_bits.nwords(size * 8) + _bits.SLACK, np.uint64)
    words[(size >> 3) :] = 0  # (the last word's bytes past the message, and the slack)
    _write(words, idx, u, lo, wbits, pbits, ebits, mbits, plan, tmp, tmp.view(np.uint64), marks)
    return words.view(np.uint8)[:size]


def padded(msg: np.ndarray) -> np.ndarray:
    """``msg`` (1-D uint8) and the zero bytes after it up to a multiple of 8: a view where
    the array holding it has them zeroed (as :func:`encode_pairs` makes it), else a copy.
    Messages sent so land at 8-aligned offsets of a receive buffer, where :func:`decode_pairs`
    reads them without a copy (given their exact lengths)."""
    size = msg.shape[0]
    whole = slot(size)
    view = _beyond(msg, 0, whole, False) if whole >= IN_PLACE else None
    if view is not None and not view[size:].any():
        return view
    out = np.zeros(whole, np.uint8)
    out[:size] = msg
    return out


def slot(size: int) -> int:
    """Bytes a message of ``size`` bytes takes with its zero bytes to a multiple of 8."""
    return (int(size) + 7) & ~7


def _beyond(buf: np.ndarray, start: int, nbytes: int, align: bool) -> np.ndarray | None:
    """``nbytes`` bytes from byte ``start`` of the 1-D uint8 ``buf`` on, past its end if need
    be, as a view of the writable array holding it (``align``: starting 8-aligned); None
    where that array ends first, or ``buf`` is not one run of bytes."""
    if buf.strides[0] != 1:
        return None
    root = buf
    while root.base is not None:
        root = root.base
        if not isinstance(root, np.ndarray):
            return None
    if not root.flags.writeable:
        return None
    at = _offset(buf, start, nbytes, root, align)
    if at < 0:
        return None
    try:
        return np.frombuffer(root, np.uint8, nbytes, at)
    except (ValueError, BufferError):  # (a root that is not one C-ordered block)
        return None


@cached_njit(nogil=True)
def _offset(buf, start, nbytes, root, align):
    """Where byte ``start`` of ``buf`` lies in ``root``, if ``nbytes`` bytes from it lie in
    ``root`` too (and, with ``align``, it is 8-aligned); -1 otherwise."""
    at = np.int64(buf.ctypes.data) + start
    first = np.int64(root.ctypes.data)
    if (align and at % 8 != 0) or at < first or at + nbytes > first + root.nbytes:
        return np.int64(-1)
    return at - first


def encoded_size(indices: Any, values: Any, lo: int, hi: int) -> int:
    """Bytes :func:`encode_pairs` makes of these pairs."""
    return int(encode_pairs(indices, values, lo, hi).shape[0])


# what _read_head's error codes mean (its second value fills the {})
_HEAD_ERRORS = {
    1: "wire message: header cut short",
    2: "wire message: bad varint in the header",
    3: "wire message: unknown index format {}",
    4: "wire message: unknown value format {}",
    5: "wire message: {} bytes left over",
    6: "wire message: bad parameters in the header",
    7: "wire message: section cut short",
}


@cached_njit(inline="always")
def _pbits(m):
    """The bits of a pair's position in a message of m pairs (``_width(m − 1)``)."""
    return 64 - np.int64(_bits._clz(np.uint64(m - 1))) if m > 1 else 1


@cached_njit(nogil=True)
def _read_head(buf, wbits, ebits, mbits, isz, d):
    """Read a message's header and lay out its sections, checked against its length, in
    one compiled call (no per-field Python work a message). Returns
    (error, detail, ifmt, vfmt, m, first or b, span or nesc, emin, w, section start,
    index words, value bytes, gap plane offset, gap exceptions offset, the words to decode
    from): error 0, or a key of :data:`_HEAD_ERRORS`. Varints past 63 bits are refused (no
    count or offset needs them), and a count past 8 bits a byte of the message is cut short
    before any size is computed from it, so no size overflows."""
    n = buf.shape[0]
    end = min(n, HEAD)
    vals = np.zeros(6, np.int64)  # m, p1, p2, emin (varints and bytes, in header order)
    pos = 0
    if pos >= end:
        return 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
    tag = np.int64(buf[pos])
    pos += 1
    ifmt, vfmt = tag & 15, tag >> 4
    # the fields: m, then the index format's, then the value format's (kind 0: varint,
    # kind 1: byte)
    kinds = np.zeros(5, np.int64)
    nf = 1
    if ifmt == I_BITMAP:
        nf = 3
    elif ifmt == I_GAPS:
        kinds[1] = 1
        nf = 3
    elif ifmt != I_RAW and ifmt != I_PACKED:
        return 3, ifmt, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
    if vfmt == V_SPLIT:
        kinds[nf + 1] = 1
        nf += 2
    elif vfmt != V_RAW:
        return 4, vfmt, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
    for f in range(nf):
        if kinds[f] == 1:
            if pos >= end:
                return 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
            vals[f] = np.int64(buf[pos])
            pos += 1
            continue
        v = np.int64(0)
        shift = 0
        while True:
            if pos >= end:
                return 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
            byte = np.int64(buf[pos])
            pos += 1
            if shift == 56 and byte > 127:
                return 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
            v |= (byte & 127) << shift
            shift += 7
            if byte < 128:
                break
        vals[f] = v
    m = vals[0]
    two = ifmt in (I_BITMAP, I_GAPS)  # (an index format with two parameters)
    p1, p2 = (vals[1], vals[2]) if two else (0, 0)
    k = 3 if two else 1
    emin, w = (vals[k], vals[k + 1]) if vfmt == V_SPLIT else (0, 0)
    if m == 0:
        if pos != n:
            return 5, n - pos, ifmt, vfmt, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
        return 0, 0, ifmt, vfmt, 0, p1, p2, emin, w, pos, 0, 0, 0, 0, 0
    if (ifmt == I_GAPS and p1 > wbits) or (vfmt == V_SPLIT and w >= ebits):
        return 6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
    bits = 8 * n
    if m > bits or (two and p2 > bits):
        return 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
    l0 = l1 = 0
    if ifmt == I_RAW:
        iw = _bits.nwords(m * isz * 8)
    elif ifmt == I_PACKED:
        iw = _bits.nwords(m * wbits)
    elif ifmt == I_BITMAP:
        iw = _bits.nwords(p2)
    else:
        l0, l1, iw = _gaps.layout(m, p1, p2, _pbits(m), wbits - p1)
    cnt = m * d
    if vfmt == V_RAW:
        vbytes = cnt * ((1 + ebits + mbits) >> 3)
    else:
        before, last = _values.layout(cnt, mbits, w)
        vbytes = before * 8 + last
    hb = _bits.nwords(pos * 8) * 8
    size = hb + iw * 8 + vbytes
    if size > n:
        return 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
    if size < n:
        return 5, n - size, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
    words = iw + _bits.nwords(vbytes * 8) + _bits.SLACK  # (zeros past the body)
    return 0, 0, ifmt, vfmt, m, p1, p2, emin, w, hb, iw, vbytes, l0, l1, words


_BODY_ERRORS = {
    1: "wire message: bitmap does not hold m indices",
    2: "wire message: the gaps do not hold m indices in range",
    3: "wire message: indices outside [{}, {})",
}


@cached_njit(nogil=True)
def _read_body(head, words, idx, u, tmp, scratch, lo, hi, wbits, ebits, mbits):
    """Decode the sections :func:`_read_head` laid out from ``words`` (the body, whole
    words, zeros past it for the kernels' word reads) into ``idx`` and ``u``, in one
    compiled call, then check the indices' range. Raw sections are the caller's to copy
    (a Numba byte loop is much slower than numpy's copy). Returns 0, or a key of
    :data:`_BODY_ERRORS`."""
    ifmt, vfmt, m, p1, p2, emin, w = head[2:9]
    iw, p0, e0 = head[10], head[12], head[13]
    if ifmt == I_PACKED:
        _bits.pack_decode(words, lo, wbits, idx)
    elif ifmt == I_BITMAP:
        if _bits.bitmap_decode(words[:iw], lo + p1, idx) != m:
            return 1
    elif ifmt == I_GAPS:
        t = tmp[: ((m + 7) >> 3) * 8]
        if not _gaps.gaps_decode(
            words, lo, hi, p1, _pbits(m), wbits - p1, p2, p0, e0, t, t.view(np.uint64), idx
        ):
            return 2
    if vfmt == V_SPLIT:
        t64 = tmp.view(np.uint64)
        _values.split_decode(words[iw:], mbits, ebits, emin, w, tmp, t64, u, scratch)
    if np.int64(idx[0]) < lo or np.int64(idx[m - 1]) >= hi:
        return 3
    return 0


def decode_pairs(
    buf: Any, itype: Any, vtype: Any, lo: int, hi: int, width: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Decode an :func:`encode_pairs` message into new (indices, values) arrays.

    ``itype``, ``vtype``, ``lo``, ``hi`` and ``width`` (D for rows of D values, None for
    a 1-D values array) must be those the sender had. Raises ValueError for a message
    that does not decode to exactly its length.

    The message is read where it lies when its sections start at an 8-aligned address and
    the array holding it goes on for the two words the kernels may read past its end (their
    bits unused), as in a receive buffer of :func:`padded` messages; otherwise from a copy.
    """
    buf = np.asarray(buf, np.uint8).reshape(-1)
    itype, vtype = np.dtype(itype), np.dtype(vtype)
    lo, hi = int(lo), int(hi)
    d = 1 if width is None else int(width)
    wbits = _width(hi - 1 - lo)
    utype, ebits, mbits = _values.FLOATS[vtype]
    head = _read_head(buf, wbits, ebits, mbits, itype.itemsize, d)
    err, detail, m, w, iw = head[0], head[1], head[4], head[8], head[10]
    if err:
        raise ValueError(_HEAD_ERRORS[err].format(detail))
    shape = (m,) if width is None else (m, d)
    if m == 0:
        return np.empty(0, itype), np.empty(shape, vtype)
    idx = np.empty(m, itype)
    u = np.empty(m * d, utype)
    tmp = _scratch(m * d)
    scratch = np.empty(m * d if w and mbits != 23 else 0, np.uint16)  # (B: w <= 10 bits)
    body = buf[head[9] :]
    words = _beyond(buf, head[9], head[14] * 8, True) if head[14] * 8 >= IN_PLACE else None
    if words is not None:
        words = words.view(np.uint64)
    else:
        words = np.empty(head[14], np.uint64)
        words[-_bits.SLACK - 1 :] = 0
        words.view(np.uint8)[: body.shape[0]] = body
    if head[2] == I_RAW:
        idx.view(np.uint8)[:] = body[: idx.nbytes]
    if head[3] == V_RAW:
        u.view(np.uint8)[:] = body[iw * 8 :]
    err = _read_body(head, words, idx, u, tmp, scratch, lo, hi, wbits, ebits, mbits)
    if err:
        raise ValueError(_BODY_ERRORS[err].format(lo, hi))
    return idx, u.view(vtype).reshape(shape)
