"""GPU time of sparsecoll's selection and of its kernels one by one, on a CuPy vector.

    python bench/gpu_kernels.py            # n = 100M float32, N(0, 1)

Each line: the median GPU and host time of 30 calls (``cupyx.profiler.benchmark``, 3 warm-up
calls): the public functions at k = n/1000 and n/100 (threshold 2.5) beside ``torch.topk``
of ``|x|``, then the passes that make them up, and one ``cupy.copyto`` of the vector for
scale (docs/reports/gpu.md, "Measured figures").
"""

from __future__ import annotations

import argparse

import numpy as np


def main(argv: list[str] | None = None) -> None:
    from sparsecoll.benchmarks.cli import SIZE_HELP, size_arg

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=SIZE_HELP)
    ap.add_argument("-m", "--size", type=size_arg, default="100M")
    n = ap.parse_args(argv).size
    import cupy as cp  # after the arguments: --help works without CuPy
    from cupyx.profiler import benchmark

    from sparsecoll.select import _cupy as s
    from sparsecoll.select import _cupy_kernels as ck

    x = cp.random.default_rng(0).standard_normal(n, dtype=cp.float32)
    bits, absmask, infkey = s._bits(x)
    ut = bits.dtype.type
    tiles = -(-n // ck.TILE)

    def report(name, fn, *args):
        r = benchmark(fn, args, n_repeat=30, n_warmup=3)
        gpu, cpu = np.median(r.gpu_times[0]) * 1e3, np.median(r.cpu_times) * 1e3
        print(f"{name:28s} gpu {gpu:8.3f} ms  cpu {cpu:8.3f} ms")

    try:
        import torch

        torch_x = torch.from_dlpack(x)
    except Exception:  # (no torch with CUDA: its lines are left out)
        torch_x = None
    for k in (n // 1000, n // 100):
        print("k =", k)
        report("topk", s.topk, x, k)
        report("kth_largest_abs", s.kth_largest_abs, x, k)
        report("threshold(2.5)", s.threshold, x, 2.5)
        report("count_ge(2.5)", s.count_ge, x, 2.5)
        if torch_x is not None:
            report("torch.topk(|x|)", lambda t, k: torch.topk(t.abs(), k), torch_x, k)
    report("histogram pass", s._histogram, bits, absmask, infkey, 0, 0, 19)
    counts = cp.empty(tiles, dtype=np.uint32)
    cand = cp.empty(n // 50, dtype=np.uint64)
    ncand = cp.zeros(1, dtype=np.uint64)
    gather = ck.kernel(cp, "sc_gather_packed", 4)
    # the bin of |x| in [32, 34): no N(0, 1) entry falls there, so this times the pass's
    # reads and tile counts without candidates
    digit = 2048 + 16 * 4
    args = (bits, np.int64(n), absmask, ut(0xFFF << 19), ut(digit << 19), cand, ncand, counts)

    def gather_pass():
        ncand.fill(0)
        gather((tiles,), (ck.BLOCK,), args)

    report("gather_packed pass", gather_pass)
    print("candidates in that bin", int(ncand[0]))
    packed = cp.random.default_rng(1).integers(0, 2**62, 1 << 20, dtype=cp.uint64)
    report("sort 1M uint64", cp.sort, packed)
    report("cumsum of tile counts", lambda: cp.cumsum(counts, dtype=np.uint64))
    cut = s._device_cut(s._threshold_key(x, 2.5), n)
    report("count pass", s._count, x, cut)
    c, e, t = s._count(x, cut)
    report("write pass", s._write, x, cut, c, e, t)
    mask = cp.abs(x) >= 2.5
    report("flatnonzero_mask", s.flatnonzero_mask, mask)
    report("cupy.flatnonzero", cp.flatnonzero, mask)
    y = cp.empty_like(x)
    report("copy", cp.copyto, y, x)


if __name__ == "__main__":
    main()
