"""Compact, lossless wire encoding of sorted unique indices and their values.

:func:`encode_pairs` turns host arrays (indices ascending and unique in a range [lo, hi)
both sides know; values float16/32/64, one per index or rows of D) into one uint8 message;
:func:`decode_pairs` gives back the same bits. Each message takes the smallest of its
index formats (bit-packed offsets, a bitmap over the indices' span, gaps in a width fitted
to the message with the wider ones patched, raw) and value formats (sign, exponent offset
from the message's smallest exponent in just enough bits, mantissa as is; or raw), named by
a tag byte at its start. At 1% density the gaps cost about 9.2 bits per index, and standard
normal float32 values about 3.6 bytes. The layout is in :mod:`._format`.
"""

from __future__ import annotations

from ._format import decode_pairs, encode_pairs, encoded_size, padded

__all__ = ["decode_pairs", "encode_pairs", "encoded_size", "padded"]
