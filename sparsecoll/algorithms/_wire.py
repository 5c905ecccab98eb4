"""The ``wire`` option of the algorithms that send pairs: raw, or :mod:`sparsecoll.wire`.

With ``wire="compact"`` each pair message (sorted unique indices in a range both sides know,
and their values) travels as one :func:`~sparsecoll.wire.encode_pairs` message, decoded to
the same bits, so results are bit-identical to ``"raw"``; dense messages stay raw, and the
decisions between dense and sparse are the raw ones. CuPy arrays travel raw (the kernels
run on the host).
"""

from __future__ import annotations

import itertools
from typing import Any, ClassVar

import numpy as np

from .. import _state
from .._options import choice
from ..wire import decode_pairs, encode_pairs, padded
from ..wire._format import SPARE, slot

__all__ = [
    "WIRES", "WireOption", "decode_pairs", "encode_pairs", "gathered_space", "message_space",
    "message_starts", "padded", "slot", "width",
]  # fmt: skip

WIRES = ("raw", "compact")


class WireOption:
    """An algorithm that sends pairs, its wire format fixed at construction.

    Args:
        wire: ``"raw"`` (pairs as they are) or ``"compact"`` (pair messages encoded
            losslessly, bit-identical results; CuPy arrays travel raw).
    """

    fixed_options: ClassVar[tuple[str, ...]] = ("wire",)
    state_kinds: ClassVar[dict[str, _state.Kind] | None] = {}

    def __init__(self, wire: str = "raw") -> None:
        self.wire = choice("wire", wire, WIRES)

    def signature(self) -> list[int]:
        return [WIRES.index(self.wire)]

    def compact(self, x: Any) -> bool:
        """Whether ``x``'s pair messages are encoded (``"compact"``, host arrays)."""
        return self.wire == "compact" and x.xp is np


def width(values: Any) -> int | None:
    """D for rows of D values, None for one value per index (what the decoder is told)."""
    return int(values.shape[1]) if values.ndim == 2 else None


def message_starts(sizes: Any) -> list[int]:
    """Where wire messages of these byte sizes start in one buffer that holds each in its
    8-aligned :func:`slot`, and (last) where the slots end; the buffer takes :data:`SPARE`
    bytes more, so that :func:`decode_pairs` reads each message where it lies."""
    return [0, *itertools.accumulate(slot(size) for size in sizes)]


def message_space(sizes: Any) -> list[np.ndarray]:
    """Receive buffers for wire messages of these byte sizes, in one array laid out by
    :func:`message_starts`."""
    starts = message_starts(sizes)
    space = np.empty(starts[-1] + SPARE, np.uint8)
    return [space[a : a + int(size)] for a, size in zip(starts[:-1], sizes, strict=True)]


def gathered_space(sizes: Any, rank: int, mine: Any) -> tuple[np.ndarray, list[int]]:
    """The buffer an allgather of every rank's wire message (these byte sizes) forwards
    slots of, laid out by :func:`message_starts`, ``mine`` (``rank``'s message, or None)
    in its slot with its zero bytes; and the starts."""
    starts = message_starts(sizes)
    space = np.empty(starts[-1] + SPARE, np.uint8)
    if mine is not None:
        space[starts[rank] : starts[rank + 1]] = padded(mine)
    return space, starts
