"""The ``wire`` option of the algorithms that send pairs: raw, or :mod:`sparsecoll.wire`.

With ``wire="compact"`` each pair message (sorted unique indices in a range both sides know,
and their values) travels as one :func:`~sparsecoll.wire.encode_pairs` message, decoded to
the same bits, so results are bit-identical to ``"raw"``; dense messages stay raw, and the
decisions between dense and sparse are the raw ones. CuPy arrays travel raw (the kernels
run on the host).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from .. import _state
from .._options import choice
from ..wire import decode_pairs, encode_pairs, padded

__all__ = [
    "WIRES", "WireOption", "decode_pairs", "encode_pairs", "message_space", "padded", "width",
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


def message_space(sizes: Any) -> list[np.ndarray]:
    """Receive buffers for wire messages of these byte sizes, in one array: each starts
    8-aligned and two words are spare after the last, so that :func:`decode_pairs` reads
    each where it lies."""
    starts, end = [], 0
    for size in sizes:
        starts.append(end)
        end += (int(size) + 7) & ~7
    space = np.empty(end + 16, np.uint8)
    return [space[a : a + int(size)] for a, size in zip(starts, sizes, strict=True)]
