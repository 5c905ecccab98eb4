"""Sparse ``dist.all_reduce`` of an embedding's gradient: torch's gloo path vs the sparsecoll
backend, in one launch, on the same tensors.

Each rank builds the gradient an ``nn.Embedding(sparse=True)`` of ``--vocab`` rows of
``--dim`` floats produces for a batch of the word LM's corpus (bench/train_cluster.py: the
tokens of this Python's standard library): random windows of ``--context`` tokens are drawn
until ``--rows`` distinct tokens are held (frequent tokens are shared by every rank, as in
training), and the gradient is a hybrid COO tensor (one index per row, a row of ``--dim``
values). Each backend reduces the same tensors ``--warmup`` + ``--iters`` times; the median
and the max over ranks of each call's time are printed, with the bytes each rank's network
interface sent per call when ``--iface`` names it (the emulated cluster's ``eth0``:
everything on the wire, TCP headers included), and the result checked against gloo's.

Methods: ``gloo`` (torch's own sparse allreduce: every rank's indices and values
allgathered, then coalesced) and ``sparsecoll:ALGO`` (a ``new_group(backend="sparsecoll")``
reducing with ALGO, e.g. ``sparsecoll:auto``). Example, 8 emulated hosts at 1 Gbit/s:

    sudo python bench/emulate_cluster.py -n 8 --rate 1gbit -- python bench/torch_sparse.py \\
        --iface eth0 --rows 575,3129 --methods gloo,sparsecoll:auto,sparsecoll:hashed
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def tx_bytes(iface: str | None) -> int:
    if not iface:
        return 0
    return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())


def draw_rows(ids: np.ndarray, rows: int, context: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted distinct token ids of random corpus windows, until ``rows`` are held."""
    seen: set[int] = set()
    cut = len(ids) * 95 // 100
    while len(seen) < rows:
        s = int(rng.integers(0, cut - context))
        for t in ids[s : s + context]:
            seen.add(int(t))
            if len(seen) == rows:
                break
    return np.array(sorted(seen), dtype=np.int64)


def make_group(dist, method: str):
    """None (the default gloo group) or a sparsecoll group reducing with the named algorithm."""
    if method == "gloo":
        return None
    _, _, algo = method.partition(":")
    os.environ["SPARSECOLL_TORCH_ALGORITHM"] = algo or "auto"
    return dist.new_group(backend="sparsecoll")


def main(argv: list[str] | None = None) -> int:
    from sparsecoll.benchmarks.cli import RankZeroParser, int_arg, ints_arg

    ap = RankZeroParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="gloo,sparsecoll:auto")
    ap.add_argument("--rows", type=ints_arg(1), default=[575, 3129], help="rows per rank")
    ap.add_argument("--vocab", type=int_arg(1), default=32768)
    ap.add_argument("--dim", type=int_arg(1), default=256)
    ap.add_argument("--context", type=int_arg(1), default=64)
    ap.add_argument("--warmup", type=int_arg(0), default=3)
    ap.add_argument("--iters", type=int_arg(1), default=10)
    ap.add_argument("--seed", type=int_arg(0), default=0)
    ap.add_argument("--iface", default=None, help="network interface (e.g. eth0)")
    ap.add_argument("--cache-dir", type=Path, default=Path("/tmp"))
    args = ap.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]

    import torch
    import torch.distributed as dist
    from train_cluster import load_corpus, rendezvous_address

    import sparsecoll.integrations.torch  # noqa: F401  (registers the backend)
    from sparsecoll.comm import Communicator
    from sparsecoll.integrations.torch import init_process_group

    torch.set_num_threads(1)
    os.environ.setdefault("SPARSECOLL_NUM_THREADS", "1")
    comm = Communicator()
    addr = None
    if args.iface:
        os.environ["GLOO_SOCKET_IFNAME"] = args.iface
        addr = rendezvous_address(comm, args.iface)
    ids = load_corpus(comm, args.vocab, args.cache_dir)
    init_process_group(comm, addr=addr)
    groups = {m: make_group(dist, m) for m in methods}
    if comm.rank == 0:
        print(
            f"# torch_sparse P={comm.size} vocab={args.vocab} dim={args.dim} "
            f"iface={args.iface} load={os.getloadavg()}"
        )
        print("rows/rank,union,method,median_ms,max_ms,tx_bytes/rank/call,max_abs_diff")
    for rows in args.rows:
        rng = np.random.default_rng([args.seed, comm.rank, rows])
        idx = draw_rows(ids, rows, args.context, rng)
        vals = rng.standard_normal((idx.shape[0], args.dim)).astype(np.float32)
        grad = torch.sparse_coo_tensor(
            torch.from_numpy(idx)[None],
            torch.from_numpy(vals),
            (args.vocab, args.dim),
            check_invariants=True,
        ).coalesce()
        reference, union = None, 0
        for method in methods:
            times, sent = [], []
            out = None
            for it in range(args.warmup + args.iters):
                t = grad.clone()
                dist.barrier()
                b0, t0 = tx_bytes(args.iface), time.perf_counter()
                dist.all_reduce(t, group=groups[method])
                t1, b1 = time.perf_counter(), tx_bytes(args.iface)
                if it >= args.warmup:
                    times.append(t1 - t0)
                    sent.append(b1 - b0)
                out = t
            out = out.coalesce()
            dense = out.to_dense()
            if reference is None:
                reference = dense
                union = int(out.indices().shape[1])
            diff = float((dense - reference).abs().max())
            med = float(np.median(times))
            worst = comm.allreduce_floats([med], op="max")[0]
            bytes_med = comm.allreduce_floats([float(np.median(sent))], op="max")[0]
            if comm.rank == 0:
                print(
                    f"{rows},{union},{method},{med * 1e3:.2f},{worst * 1e3:.2f},"
                    f"{int(bytes_med)},{diff:.3g}",
                    flush=True,
                )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
