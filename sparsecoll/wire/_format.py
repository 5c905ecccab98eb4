"""The message layout: header, index section, value section; the smallest format is chosen.

Header: one tag byte (index format in the low nibble, value format in the high one), the
pair count m as a LEB128 varint, then the index format's parameters, then the value
format's. Index formats: RAW (m
indices of the index dtype), PACKED (``i − lo`` in W = bits(hi − 1 − lo) bits each), BITMAP
(varints ``first − lo`` and ``span``, then span bits over [first, first + span)), RICE (a
byte k and the section's length in bytes as a varint, then the gap code of :mod:`._bits`).
Value formats: RAW (the values' bytes) and SPLIT (varint emin, byte w, then the fields of
:mod:`._values`). Sections follow the header back to back, each a whole number of bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _bits, _values

__all__ = ["decode_pairs", "encode_pairs", "encoded_size"]

I_RAW, I_PACKED, I_BITMAP, I_RICE = 0, 1, 2, 3
V_RAW, V_SPLIT = 0, 1
INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


class _Reader:
    """Reads the header's varints and bytes; ValueError past the end."""

    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.pos = buf, 0

    def byte(self) -> int:
        if self.pos >= self.buf.shape[0]:
            raise ValueError("wire message: header cut short")
        self.pos += 1
        return int(self.buf[self.pos - 1])

    def varint(self) -> int:
        v = shift = 0
        while True:
            b = self.byte()
            v |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return v
            if shift > 70:
                raise ValueError("wire message: bad varint in the header")

    def section(self, nbytes: int) -> np.ndarray:
        if self.pos + nbytes > self.buf.shape[0]:
            raise ValueError("wire message: section cut short")
        self.pos += nbytes
        return self.buf[self.pos - nbytes : self.pos]


def _words(nbits: int) -> np.ndarray:
    return np.zeros((nbits + 63) // 64 + _bits.SLACK, np.uint64)


def _stream(words: np.ndarray, nbits: int) -> np.ndarray:
    return words.view(np.uint8)[: (nbits + 7) // 8]


def _read_words(section: np.ndarray) -> np.ndarray:
    words = np.zeros((section.shape[0] + 7) // 8 + _bits.SLACK, np.uint64)
    words.view(np.uint8)[: section.shape[0]] = section
    return words


def _width(span: int) -> int:
    return max(1, int(span).bit_length())


def _index_section(idx: np.ndarray, lo: int, hi: int) -> tuple[int, bytes, Any]:
    """The smallest index format: (format, header parameters, section bytes)."""
    m = idx.shape[0]
    counts, sums = _bits.gap_stats(idx, lo, hi)
    if counts[0] < 0:
        raise ValueError(f"indices must be ascending, unique and in [{lo}, {hi})")
    wbits = _width(hi - 1 - lo)
    first, span = int(idx[0]), int(idx[-1]) - int(idx[0]) + 1
    sizes = {I_RAW: m * idx.itemsize, I_PACKED: (m * wbits + 7) // 8, I_BITMAP: (span + 7) // 8}
    k, est = _bits.rice_parameter(counts, sums, wbits)
    if (est - m) / 8 < min(sizes.values()):  # (the estimate is within m bits)
        words = _words(int(est) + m + 64)
        nbits = _bits.rice_encode(idx, lo, k, wbits, words)
        out = _stream(words, nbits)
        if out.shape[0] + 6 < min(sizes.values()):
            return I_RICE, bytes([k]) + _varint(out.shape[0]), out
    fmt = min(sizes, key=lambda f: (sizes[f], -f))  # (ties: the simpler decode)
    if fmt == I_RAW:
        return fmt, b"", idx.view(np.uint8)
    if fmt == I_PACKED:
        words = _words(m * wbits)
        _bits.pack_encode(idx, lo, wbits, words)
        return fmt, b"", _stream(words, m * wbits)
    words = _words(span)
    _bits.bitmap_encode(idx, first, words)
    return fmt, _varint(first - lo) + _varint(span), _stream(words, span)


def _value_section(values: np.ndarray) -> tuple[int, bytes, Any]:
    """SPLIT where it is smaller than the values' bytes, else RAW."""
    utype, ebits, mbits = _values.FLOATS[values.dtype]
    u = values.reshape(-1).view(utype)
    emin, emax = _values.exponent_range(u, mbits, ebits)
    w = int(emax - emin).bit_length()
    nb = 1 + w + mbits
    if w >= ebits or not u.shape[0]:
        return V_RAW, b"", u.view(np.uint8)
    words = _words(u.shape[0] * nb)
    _values.split_encode(u, mbits, ebits, emin, w, words)
    return V_SPLIT, _varint(int(emin)) + bytes([w]), _stream(words, u.shape[0] * nb)


def encode_pairs(indices: Any, values: Any, lo: int, hi: int) -> np.ndarray:
    """Encode sorted unique ``indices`` in [lo, hi) and their ``values`` losslessly.

    Args:
        indices: 1-D int32 or int64 host array, ascending, unique, in [lo, hi).
        values: float16/32/64 host array of shape (m,) or (m, D) (rows: the decoder is
            told D).
        lo, hi: the range both sides know the indices lie in.

    Returns:
        A uint8 array: the message :func:`decode_pairs` reads.
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
        return np.frombuffer(bytes([0]) + _varint(0), np.uint8).copy()
    ifmt, ihead, isec = _index_section(idx, int(lo), int(hi))
    vfmt, vhead, vsec = _value_section(vals)
    head = bytes([ifmt | vfmt << 4]) + _varint(m) + ihead + vhead
    out = np.empty(len(head) + isec.shape[0] + vsec.shape[0], np.uint8)
    out[: len(head)] = np.frombuffer(head, np.uint8)
    out[len(head) : len(head) + isec.shape[0]] = isec
    out[len(head) + isec.shape[0] :] = vsec
    return out


def encoded_size(indices: Any, values: Any, lo: int, hi: int) -> int:
    """Bytes :func:`encode_pairs` makes of these pairs."""
    return int(encode_pairs(indices, values, lo, hi).shape[0])


def decode_pairs(
    buf: Any, itype: Any, vtype: Any, lo: int, hi: int, width: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Decode an :func:`encode_pairs` message into new (indices, values) arrays.

    ``itype``, ``vtype``, ``lo``, ``hi`` and ``width`` (D for rows of D values, None for
    a 1-D values array) must be those the sender had. Raises ValueError for a message
    that does not decode to exactly its length.
    """
    buf = np.asarray(buf, np.uint8).reshape(-1)
    itype, vtype = np.dtype(itype), np.dtype(vtype)
    lo, hi = int(lo), int(hi)
    rd = _Reader(buf)
    tag = rd.byte()
    ifmt, vfmt = tag & 15, tag >> 4
    m = rd.varint()
    d = 1 if width is None else int(width)
    shape = (m,) if width is None else (m, d)
    wbits = _width(hi - 1 - lo)
    if ifmt == I_BITMAP:
        first, span = lo + rd.varint(), rd.varint()
    elif ifmt == I_RICE:
        k, nbytes = rd.byte(), rd.varint()
    elif ifmt not in (I_RAW, I_PACKED):
        raise ValueError(f"wire message: unknown index format {ifmt}")
    if vfmt == V_SPLIT:
        emin, w = rd.varint(), rd.byte()
    elif vfmt != V_RAW:
        raise ValueError(f"wire message: unknown value format {vfmt}")
    idx = np.empty(m, itype)
    if m == 0:
        pass
    elif ifmt == I_RAW:
        idx.view(np.uint8)[:] = rd.section(m * itype.itemsize)
    elif ifmt == I_PACKED:
        _bits.pack_decode(_read_words(rd.section((m * wbits + 7) // 8)), lo, wbits, idx)
    elif ifmt == I_BITMAP:
        words = _read_words(rd.section((span + 7) // 8))
        if _bits.bitmap_decode(words, first, idx) != m:
            raise ValueError("wire message: bitmap does not hold m indices")
    elif not _bits.rice_decode(_read_words(rd.section(nbytes)), nbytes * 8, lo, k, wbits, idx):
        raise ValueError("wire message: Rice stream cut short")
    utype, ebits, mbits = _values.FLOATS[vtype]
    u = np.empty(m * d, utype)
    if vfmt == V_RAW:
        u.view(np.uint8)[:] = rd.section(u.nbytes)
    else:
        nbits = m * d * (1 + w + mbits)
        _values.split_decode(_read_words(rd.section((nbits + 7) // 8)), mbits, ebits, emin, w, u)
    if rd.pos != buf.shape[0]:
        raise ValueError(f"wire message: {buf.shape[0] - rd.pos} bytes left over")
    if m and (int(idx[0]) < lo or int(idx[-1]) >= hi):
        raise ValueError(f"wire message: indices outside [{lo}, {hi})")
    return idx, u.view(vtype).reshape(shape)
