"""How the hashed algorithm's runs travel: COO offsets, or a bitmap over the range, plus values.

A run is ``m`` sorted unique offsets in [0, L) (an owner's range of π-values) with their
values. As COO it is m offsets of ``otype`` then m values; as a bitmap, ⌈L/8⌉ bytes (offset
o is bit o & 7 of byte o >> 3) then the m values in offset order. The smaller form is used
(COO on a tie), chosen from (m, L) alone: the counts travel first, so sender and receiver
agree on every run's form and size before its bytes arrive. Row values (``width`` D: each
entry a row of D values) travel as m·D values. This module is the one place where runs are
packed and unpacked.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .._array import aligned_view, get_array_module
from .._jit import cached_njit

__all__ = ["decode_run", "encode_run", "run_bytes", "uses_bitmap"]


def uses_bitmap(m: int, length: int, otype: Any) -> bool:
    """Whether a run of ``m`` entries in a range of ``length`` travels as a bitmap."""
    return (length + 7) // 8 < m * np.dtype(otype).itemsize


def run_bytes(m: int, length: int, otype: Any, vtype: Any, width: int = 1) -> int:
    """Bytes of a run of ``m`` entries (rows of ``width`` values) in a range of ``length``:
    the smaller form's."""
    if m == 0:
        return 0
    head = (length + 7) // 8 if uses_bitmap(m, length, otype) else m * np.dtype(otype).itemsize
    return head + m * width * np.dtype(vtype).itemsize


def encode_run(offsets: Any, values: Any, length: int, out: Any) -> None:
    """Write the run (``offsets`` of the offset dtype, ascending) into the byte array ``out``.

    ``out`` holds exactly ``run_bytes(m, length, offsets.dtype, values.dtype)`` bytes.
    """
    m = int(offsets.shape[0])
    if m == 0:
        return
    vbytes = values.nbytes
    head = out[: out.shape[0] - vbytes]
    if uses_bitmap(m, length, offsets.dtype):
        xp = get_array_module(out)
        if xp is np:
            head[:] = 0
            _set_bits()(np.ascontiguousarray(offsets), head)
        else:
            bits = xp.zeros(length, dtype=bool)
            bits[offsets] = True
            head[:] = xp.packbits(bits, bitorder="little")
    else:
        head[:] = offsets.view(np.uint8)
    out[out.shape[0] - vbytes :] = values.reshape(-1).view(np.uint8)


def decode_run(
    buf: Any, m: int, length: int, otype: Any, vtype: Any, row: tuple[int, ...] = ()
) -> tuple[Any, Any]:
    """Return ``(offsets, values)`` of a run encoded by :func:`encode_run` (views or copies);
    ``row``: the shape of an entry's values (``(D,)`` for rows)."""
    otype, vtype = np.dtype(otype), np.dtype(vtype)
    xp = get_array_module(buf)
    if m == 0:
        return xp.zeros(0, otype), xp.zeros((0, *row), vtype)
    split = buf.shape[0] - m * vtype.itemsize * (row[0] if row else 1)
    values = aligned_view(buf[split:], vtype).reshape((m, *row))
    if not uses_bitmap(m, length, otype):
        return aligned_view(buf[:split], otype), values
    if xp is np:
        offsets = np.empty(m, otype)
        found = _get_bits()(np.ascontiguousarray(buf[:split]), offsets)
    else:
        bits = xp.unpackbits(buf[:split], bitorder="little")[:length]
        offsets = xp.flatnonzero(bits).astype(otype)
        found = int(offsets.shape[0])
    if found != m:
        raise RuntimeError(f"corrupt bitmap run: {found} bits set, expecting {m}")
    return offsets, values


@functools.cache
def _set_bits() -> Any:
    @cached_njit(nogil=True)
    def set_bits(offsets, out):  # pragma: no cover - compiled
        for t in range(offsets.shape[0]):
            o = offsets[t]
            out[o >> 3] |= np.uint8(1 << (o & 7))

    return set_bits


@functools.cache
def _get_bits() -> Any:
    low_bit = np.array([(v & -v).bit_length() - 1 for v in range(256)], dtype=np.int64)

    @cached_njit(nogil=True)
    def get_bits(bits, out, low_bit):  # pragma: no cover - compiled
        # the positions of the set bits, ascending, lowest set bit first within a byte; at
        # most out.shape[0] are written
        m = out.shape[0]
        k = 0
        for b in range(bits.shape[0]):
            byte = np.int64(bits[b])
            while byte:
                if k < m:
                    out[k] = b * 8 + low_bit[byte]
                k += 1
                byte &= byte - 1
        return k

    return lambda bits, out: get_bits(bits, out, low_bit)
