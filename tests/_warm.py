"""Compile the Numba kernels into the cache, in a process of its own beside a test session.

The in-process tests run on one core; on a clean clone their first calls would compile the
kernels there, one after another. tests/conftest.py starts this at the session's start, so the
kernels compile on another core meanwhile; a kernel both want compiles once (sparsecoll._jit's
lock), and whichever comes second loads it from the cache.
"""

from __future__ import annotations

import numpy as np

from sparsecoll import GradientReducer, select

select.warmup(parallel=True)
rng = np.random.default_rng(0)
for dtype in (np.float32, np.float64, np.float16):
    grads = [rng.standard_normal(1 << 12).astype(dtype) for _ in range(3)]
    for algorithm in ("oktopk", "exdyna", "allgather"):
        red = GradientReducer(None, n=1 << 12, algorithm=algorithm, density=0.01)
        for g in grads:
            red.step(g)

# the compact wire's kernels: both index dtypes, every value dtype, 1-D and rows, sparse and
# dense messages, read from a copy and in place
from sparsecoll.wire import decode_pairs, encode_pairs, padded  # noqa: E402

n = 1 << 14
for itype in (np.int32, np.int64):
    for step in (7, 1):
        idx = np.arange(0, n, step, dtype=itype)
        for dtype in (np.float32, np.float64, np.float16):
            for width in (None, 2):
                shape = (idx.size,) if width is None else (idx.size, width)
                vals = rng.standard_normal(shape).astype(dtype)
                msg = encode_pairs(idx, vals, 0, n)
                for buf in (msg, padded(msg)[: msg.size]):  # (a copy; in place)
                    decode_pairs(buf, idx.dtype, vals.dtype, 0, n, width)
