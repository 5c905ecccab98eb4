"""Time to loss of DDP training on a slow cluster: dense (gloo) vs sparsecoll's hooks.

Trains a small word-level transformer language model with PyTorch DDP once per method, from
the same seeds, and writes a CSV per method with a row per step: forward, backward and
optimizer time, the time the step's communication was in flight, wall-clock (evaluation
excluded) and, every ``--eval-every`` steps, the held-out loss. Communication per step is
measured two ways: ``comm_s``, the time some bucket's communication was in flight (from its
hook's call to its future's completion, union over buckets), and ``wait_s``, the time
backward spent on it (inside the hooks, plus DDP's wait for the futures after the last hook
returned); the summary adds "exposed" = median step − the ``compute`` method's median step.
``buckets_ms`` lists each bucket's span (its hook's call - its future's completion, in ms
from the start of backward), rank 0's. Methods:

  compute        no communication at all (a hook that returns the local bucket): the compute
                 time of a step, to which the others are compared; not evaluated
  dense          DDP's gloo allreduce (torch's ``allreduce_hook``, what DDP runs without a hook)
  ALGO           sparsecoll's synchronous ``sparse_allreduce_hook`` (e.g. oktopk, exdyna)
  ALGO-async     sparsecoll's ``async_sparse_allreduce_hook`` (same state, a pending future)
  embed-gloo     ``nn.Embedding(sparse=True)``, no hook, DDP on the gloo group: the
                 embedding's sparse gradient goes through torch's own sparse allreduce
  embed-sparsecoll  the same model, DDP on a ``new_group(backend="sparsecoll")`` process
                 group: the sparse gradient is reduced by sparsecoll (algorithm from
                 ``SPARSECOLL_TORCH_ALGORITHM``, default auto), dense buckets by gloo

The embed methods train with SparseAdam on the embedding and Adam on the rest (SGD with
``--optimizer sgd``).

``dense`` (or ``embed-gloo`` when ``dense`` is not run) runs ``--steps`` steps; its final
held-out loss is the target. Every later method
stops at its first evaluation at or below the target, or when it has used ``--time-factor``
times dense's wall-clock (default 1: then it is no faster), or after ``--max-steps``.

Data (offline): the ``.py`` sources of the running CPython's standard library (no
site-packages, no tests), split into words, numbers, punctuation and newlines; the
``--vocab`` - 1 most frequent tokens plus ``<unk>``; the last 5% of the token stream (in
sorted file order) is held out. Model: token embedding (untied) + learned positions, pre-norm
transformer layers, and an adaptive softmax (Grave et al. 2017), as word-level models with
large vocabularies use, so that the embedding and output parameters dominate the bytes while
compute per token stays small.

On an emulated cluster (bench/emulate_cluster.py; ``--iface eth0`` makes gloo use the
namespace's link and rank 0's address on it the rendezvous):

  python bench/emulate_cluster.py -n 4 --rate 1gbit -- python bench/train_cluster.py \\
      --iface eth0 --methods compute,dense,oktopk,exdyna --out-dir docs/reports/data/ttl_p4
  python bench/plot_train_cluster.py docs/reports/data/ttl_p4
"""

from __future__ import annotations

import csv
import fcntl
import hashlib
import itertools
import os
import re
import socket
import struct
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path

import numpy as np

import sparsecoll
from sparsecoll.comm import Communicator, mpi_library_version

FIELDS = (
    "method",
    "step",
    "forward_s",
    "backward_s",
    "optimizer_s",
    "step_s",
    "comm_s",
    "hook_s",
    "wait_s",
    "wall_s",
    "train_loss",
    "eval_loss",
    "lr",
    "bytes_sent",
    "buckets_ms",
)
TOKEN = re.compile(r"[A-Za-z_][A-Za-z_0-9]*|\d+|\n[\s]*|[^\sA-Za-z_0-9]")
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "lib2to3"}


# -- data -------------------------------------------------------------------------------------
def stdlib_words() -> list[str]:
    """The token stream of the stdlib sources (sorted file order)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for p in sorted(root.rglob("*.py")):
        if SKIP_DIRS.isdisjoint(p.relative_to(root).parts):
            texts.append(p.read_text(encoding="utf-8", errors="replace"))
    return [w if w[0] != "\n" else "\n" for w in TOKEN.findall("\n".join(texts))]


def build_corpus(vocab: int) -> tuple[np.ndarray, list[str]]:
    """Token ids of the stdlib sources (sorted file order) and the vocabulary (0 = <unk>)."""
    words = stdlib_words()
    top = [w for w, _ in Counter(words).most_common(vocab - 1)]
    lut = {w: i + 1 for i, w in enumerate(top)}
    ids = np.fromiter((lut.get(w, 0) for w in words), dtype=np.int32, count=len(words))
    return ids, ["<unk>", *top]


def corpus_path(cache_dir: Path, vocab: int) -> Path:
    """The cached token ids of this Python's standard library at ``vocab``."""
    key = hashlib.sha1(f"{sys.version}|{sysconfig.get_paths()['stdlib']}|{vocab}".encode())
    return cache_dir / f"sparsecoll-ttl-corpus-{key.hexdigest()[:12]}.npy"


def load_corpus(comm: Communicator, vocab: int, cache_dir: Path) -> np.ndarray:
    """Rank 0 tokenizes once (cached in ``cache_dir``); every rank loads the cached ids.
    A cache rank 0 cannot write, or one a rank cannot read (a folder not shared between
    hosts), exits 2 on every rank, the failing rank named: it used to be that rank's
    traceback, the others waiting for it (:func:`exit_on_any`)."""
    from sparsecoll.benchmarks.cli import exit_on_any, writable

    path = corpus_path(cache_dir, vocab)
    error = None
    if comm.rank == 0 and not path.exists():
        if not writable(path):  # (before the tokenizing)
            error = f"argument --cache-dir: cannot write {path}"
        else:
            try:
                ids, _ = build_corpus(vocab)
                tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
                np.save(tmp, ids)
                tmp.replace(path)
            except OSError as exc:
                error = f"argument --cache-dir: cannot write {path}: {exc.strerror}"
    exit_on_any(comm, error)
    try:
        ids = np.load(path)
    except (OSError, ValueError) as exc:
        error = f"argument --cache-dir: cannot read {path}: {getattr(exc, 'strerror', None) or exc}"
    exit_on_any(comm, error)
    return ids


class Batches:
    """Random windows of ``context`` + 1 tokens from the first 95%; fixed held-out windows."""

    def __init__(self, torch, ids: np.ndarray, context: int, batch: int, seed: int, comm) -> None:
        cut = len(ids) * 95 // 100
        self.torch = torch
        self.train = torch.from_numpy(ids[:cut].astype(np.int64))
        held = torch.from_numpy(ids[cut:].astype(np.int64))
        self.context, self.batch = context, batch
        self.rng = np.random.default_rng([seed, comm.rank])
        starts = np.random.default_rng(seed + 1).integers(0, len(held) - context - 1, 64)
        mine = starts[comm.rank :: comm.size]  # every rank evaluates its share of the windows
        self.eval_windows = torch.stack([held[s : s + context + 1] for s in mine])

    def next(self):
        s = self.rng.integers(0, len(self.train) - self.context - 1, self.batch)
        w = self.torch.stack([self.train[i : i + self.context + 1] for i in s])
        return w[:, :-1], w[:, 1:]


def make_model(torch, args, sparse: bool = False):
    nn = torch.nn

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = args.d_model
            self.embed = nn.Embedding(args.vocab, d, sparse=sparse)
            self.pos = nn.Parameter(torch.randn(args.context, d) * 0.02)
            layer = nn.TransformerEncoderLayer(
                d, args.heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True,
                norm_first=True,
            )  # fmt: skip
            self.blocks = nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(d)
            self.out = nn.AdaptiveLogSoftmaxWithLoss(
                d, args.vocab, cutoffs=args.cutoffs, div_value=4.0
            )
            mask = nn.Transformer.generate_square_subsequent_mask(args.context)
            self.register_buffer("mask", mask, persistent=False)

        def forward(self, x, y):
            h = self.embed(x) + self.pos[: x.shape[1]]
            h = self.blocks(h, mask=self.mask, is_causal=True)
            return self.out(self.norm(h).reshape(-1, h.shape[-1]), y.reshape(-1)).loss

    return TinyLM()


def evaluate(torch, model, data: Batches, comm: Communicator) -> float:
    """Mean held-out loss (nats per token) over every rank's share of the windows."""
    with torch.no_grad():
        w = data.eval_windows
        loss = model(w[:, :-1], w[:, 1:]).item() * w[:, 1:].numel()
    total, count = comm.allreduce_floats([loss, w[:, 1:].numel()])
    return float(total / count)


# -- hooks and timing -------------------------------------------------------------------------
class Timed:
    """Wraps a DDP comm hook: records when each bucket's hook ran and when its future finished."""

    def __init__(self, hook, state) -> None:
        self.hook, self.state = hook, state
        self.spans: list[list[float]] = []  # [hook entered, hook returned, future done]
        self.hook_s = 0.0

    def reset(self) -> None:
        self.spans, self.hook_s = [], 0.0

    def wait_s(self, backward_end: float) -> float:
        """Time backward spent on communication: inside the hooks, plus DDP's wait for the
        futures after the last hook returned (the end of backward's compute)."""
        last = max((s[1] for s in self.spans), default=backward_end)
        return self.hook_s + max(0.0, backward_end - last)

    def comm_s(self) -> float:
        """Length of the union of [hook entered, future done] over this step's buckets."""
        total, end = 0.0, -1.0
        for a, _, b in sorted(self.spans):
            if b > end:
                total += b - max(a, end)
                end = b
        return total


def timed_hook(timed: Timed, bucket):
    span = [time.perf_counter(), 0.0, 0.0]
    fut = timed.hook(timed.state, bucket)
    span[1] = time.perf_counter()
    timed.hook_s += span[1] - span[0]
    timed.spans.append(span)

    def done(f):
        span[2] = time.perf_counter()
        return f.value()

    return fut.then(done)


def local_hook(_state, bucket):
    """No communication: each rank keeps its own gradient (compute-time reference)."""
    import torch

    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def method_hook(method: str, comm: Communicator, args):
    """``(hook, state, sparse state or None)`` for a method name."""
    from sparsecoll.integrations import torch as sc_torch

    if method == "compute":
        return local_hook, None, None
    if method in EMBED:
        return None, None, None
    if method == "dense":
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook, dist.group.WORLD, None
    algorithm, is_async = (method[:-6], True) if method.endswith("-async") else (method, False)
    state = sc_torch.SparseHookState(comm, algorithm, density=args.density)
    if not is_async:
        return sc_torch.sparse_allreduce_hook, state, state
    hook = getattr(sc_torch, "async_sparse_allreduce_hook", None)
    if hook is None:
        raise RuntimeError(
            f"method {method!r} needs sparsecoll.integrations.torch.async_sparse_allreduce_hook, "
            "which this version of sparsecoll does not have"
        )
    return hook, state, state


EMBED = ("embed-gloo", "embed-sparsecoll")
_GROUPS: dict = {}


def embed_group(method: str):
    """The DDP process group of a method: a sparsecoll group for embed-sparsecoll (made once)."""
    if method != "embed-sparsecoll":
        return None
    if method not in _GROUPS:
        import torch.distributed as dist

        import sparsecoll.integrations.torch  # noqa: F401  (registers the backend)

        _GROUPS[method] = dist.new_group(backend="sparsecoll")
    return _GROUPS[method]


def make_optimizer(torch, args, model, sparse: bool):
    """[Adam (fused) or SGD]; with a sparse embedding, plus SparseAdam (or SGD) on its weight."""
    params = [p for n, p in model.named_parameters() if not (sparse and n == "embed.weight")]
    if args.optimizer == "adam":  # fused: one pass per parameter (the foreach one is 8x slower)
        opts = [torch.optim.Adam(params, lr=args.lr, fused=True)]
        if sparse:
            opts.append(torch.optim.SparseAdam([model.embed.weight], lr=args.lr))
    else:
        opts = [torch.optim.SGD(params, lr=args.lr, momentum=0.9, fused=True)]
        if sparse:
            opts.append(torch.optim.SGD([model.embed.weight], lr=args.lr))
    return opts


def _has_async_hook() -> bool:
    from sparsecoll.integrations import torch as sc_torch

    return hasattr(sc_torch, "async_sparse_allreduce_hook")


def check_methods(methods: list[str]) -> None:
    """Fail before any training on a method this sparsecoll cannot run (same on every rank)."""
    if not methods:
        raise ValueError(
            "expecting method names: compute, dense, embed-gloo, embed-sparsecoll, ALGO or "
            "ALGO-async"
        )
    known = set(sparsecoll.available_algorithms())
    for m in methods:
        base = m[:-6] if m.endswith("-async") else m
        if m in ("compute", "dense", *EMBED):
            continue
        if base not in known:
            raise ValueError(f"unknown method {m!r}: expecting compute, dense, ALGO or ALGO-async")
        if m.endswith("-async") and not _has_async_hook():
            raise RuntimeError(
                f"method {m!r} needs sparsecoll.integrations.torch.async_sparse_allreduce_hook, "
                "which this version of sparsecoll does not have"
            )


# -- one run ----------------------------------------------------------------------------------
def train(args, torch, comm: Communicator, ids, method: str, target: float | None, limit):
    from torch.nn.parallel import DistributedDataParallel

    data = Batches(torch, ids, args.context, args.batch, args.seed, comm)
    torch.manual_seed(args.seed)
    model = make_model(torch, args, sparse=method in EMBED)
    ddp = DistributedDataParallel(
        model,
        bucket_cap_mb=args.bucket_mb,
        # the adaptive softmax's tail clusters are unused when no target falls in them
        find_unused_parameters=True,
        process_group=embed_group(method),
    )
    hook, state, sparse = method_hook(method, comm, args)
    timed = Timed(hook, state)
    if hook is not None:
        ddp.register_comm_hook(timed, timed_hook)
    opts = make_optimizer(torch, args, model, method in EMBED)
    warm = max(1, args.lr_warmup)
    scheds = [
        torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / warm)) for o in opts
    ]
    steps = args.compute_steps if method == "compute" else args.max_steps
    if method == args.reference:
        steps = args.steps
    rows, wall, losses = [], 0.0, []
    hook_used = hook is not None and method != "compute"
    comm.barrier()
    for step in range(1, steps + 1):
        timed.reset()
        x, y = data.next()
        t0 = time.perf_counter()
        for o in opts:
            o.zero_grad(set_to_none=method in EMBED)  # (a zeroed sparse grad keeps its rows)
        loss = ddp(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        for o, sched in zip(opts, scheds):
            o.step()
            sched.step()
        t3 = time.perf_counter()
        wall += t3 - t0
        losses.append(loss.item())
        row = {
            "method": method,
            "step": step,
            "forward_s": t1 - t0,
            "backward_s": t2 - t1,
            "optimizer_s": t3 - t2,
            "step_s": t3 - t0,
            "comm_s": timed.comm_s() if hook_used else "",
            "hook_s": timed.hook_s if hook_used else "",
            "wait_s": timed.wait_s(t2) if hook_used else "",
            "wall_s": wall,
            "train_loss": "",
            "eval_loss": "",
            "lr": scheds[0].get_last_lr()[0],
            "bytes_sent": sparse.stats()["bytes_sent_last"] if sparse else "",
            # each bucket: its hook's call - its future's completion, from backward's start
            "buckets_ms": " ".join(
                f"{(a - t1) * 1e3:.1f}-{(c - t1) * 1e3:.1f}" for a, _, c in timed.spans
            ),
        }
        rows.append(row)
        if method == "compute" or (step % args.eval_every and step != steps):
            continue
        row["eval_loss"] = evaluate(torch, model, data, comm)
        wmax = float(comm.allreduce_floats([wall], op="max")[0])
        row["train_loss"] = float(comm.allreduce_floats([np.mean(losses)])[0]) / comm.size
        losses = []
        if args.verbose and comm.rank == 0:
            print(
                f"# {method} step {step}: train {row['train_loss']:.4f} held-out "
                f"{row['eval_loss']:.4f} wall {wall:.1f}s",
                file=sys.stderr,
                flush=True,
            )
        if target is not None and row["eval_loss"] <= target:
            break
        if limit is not None and wmax >= limit:
            break
    return rows


def summarize(rows: list[dict], target: float | None, compute_s: float | None) -> dict:
    skip = min(5, len(rows) // 4)  # the first steps carry one-time costs (bucket rebuild)
    body = rows[skip:]
    keys = ("step_s", "comm_s", "wait_s", "backward_s")
    # (a method without a hook has no comm_s or wait_s: "" in its rows, None here)
    med = {k: float(np.median([r[k] for r in body])) if body[0][k] != "" else None for k in keys}
    evals = [r for r in rows if r["eval_loss"] != ""]
    reach = next((r for r in evals if target is not None and r["eval_loss"] <= target), None)
    return {
        **med,
        "steps": len(rows),
        "compute_s": compute_s,
        "exposed_s": med["step_s"] - compute_s if compute_s is not None else None,
        "final_eval": evals[-1]["eval_loss"] if evals else None,
        "reach_step": reach["step"] if reach else None,
        "reach_wall": reach["wall_s"] if reach else None,
        "wall": rows[-1]["wall_s"],
    }


def interface_address(name: str) -> str:
    """IPv4 address of network interface ``name`` (Linux)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = struct.pack("256s", name.encode()[:15])
        return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, packed)[20:24])  # SIOCGIFADDR


def rendezvous_address(comm: Communicator, iface: str) -> str | None:
    """Rank 0's IPv4 address on ``iface`` (None elsewhere): an interface rank 0 does not
    have exits 2 on every rank; it was rank 0's OSError alone, the others waiting for it in
    the process group's rendezvous."""
    from sparsecoll.benchmarks.cli import exit_on_any

    addr, error = None, None
    if comm.rank == 0:
        try:
            addr = interface_address(iface)
        except OSError as exc:
            error = f"argument --iface: no IPv4 address on {iface!r}: {exc.strerror}"
    exit_on_any(comm, error)
    return addr


def cutoffs_arg(text: str) -> list[int]:
    """``--cutoffs`` as an argparse ``type``: increasing positive integers, comma-separated
    (``AdaptiveLogSoftmaxWithLoss`` refused anything else inside torch, after the corpus)."""
    import argparse

    try:
        cutoffs = [int(c) for c in text.split(",")]
    except ValueError:
        cutoffs = []
    if not cutoffs or cutoffs[0] < 1 or any(a >= b for a, b in itertools.pairwise(cutoffs)):
        raise argparse.ArgumentTypeError(
            f"expecting increasing positive integers like 4096,16384, got {text!r}"
        )
    return cutoffs


def main(argv: list[str] | None = None) -> int:
    from sparsecoll.benchmarks.cli import (
        RankZeroParser,
        density_arg,
        float_arg,
        int_arg,
        refuse_unwritable,
    )

    # (checked before MPI starts: a usage error exits 2 on every rank, printed once)
    ap = RankZeroParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="compute,dense,oktopk,exdyna,oktopk-async,exdyna-async")
    ap.add_argument("--density", type=density_arg, default=0.01)
    ap.add_argument(
        "--steps", type=int_arg(1), default=300, help="dense steps (its end is the target)"
    )
    ap.add_argument(
        "--max-steps", type=int_arg(1), default=None, help="cap for the others (3x steps)"
    )
    ap.add_argument("--compute-steps", type=int_arg(1), default=30)
    ap.add_argument(
        "--time-factor",
        type=float_arg(0, above=True),
        default=1.0,
        help="others stop at this x dense's wall-clock",
    )
    ap.add_argument(
        "--target",
        type=float_arg(0, above=True),
        default=None,
        help="held-out loss (default: dense's)",
    )
    ap.add_argument("--eval-every", type=int_arg(1), default=10)
    ap.add_argument("--vocab", type=int_arg(1), default=32768)
    ap.add_argument(
        "--cutoffs",
        type=cutoffs_arg,
        default="4096,16384",
        help="the output's clusters: increasing ids in (0, --vocab - 1] (default %(default)s)",
    )
    ap.add_argument("--d-model", type=int_arg(1), default=256)
    ap.add_argument("--layers", type=int_arg(1), default=2)
    ap.add_argument("--heads", type=int_arg(1), default=4)
    ap.add_argument("--context", type=int_arg(1), default=64)
    ap.add_argument("--batch", type=int_arg(1), default=1, help="sequences per rank per step")
    ap.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    ap.add_argument("--lr", type=float_arg(0, above=True), default=2e-3)
    ap.add_argument(
        "--lr-warmup", type=int_arg(0), default=20, help="linear warm-up steps, then constant"
    )
    ap.add_argument("--bucket-mb", type=float_arg(0), default=25.0, help="DDP bucket_cap_mb")
    ap.add_argument("--seed", type=int_arg(0), default=0)
    ap.add_argument("--threads", type=int_arg(1), default=1, help="torch threads per rank")
    ap.add_argument("--iface", default=None, help="network interface for gloo (e.g. eth0)")
    ap.add_argument("--cache-dir", type=Path, default=Path("/tmp"))
    ap.add_argument("--out-dir", type=Path, default=None, help="a CSV per method (rank 0)")
    ap.add_argument("-v", "--verbose", action="store_true", help="progress on stderr")
    args = ap.parse_args(argv)
    if args.cutoffs[-1] >= args.vocab:  # (torch refused them after the corpus had loaded)
        ap.error(f"expecting --cutoffs below --vocab {args.vocab}, got {args.cutoffs[-1]}")
    if args.d_model % args.heads:  # (torch's attention refused it, after the corpus too)
        ap.error(f"expecting --d-model a multiple of --heads {args.heads}, got {args.d_model}")
    args.max_steps = args.max_steps or 3 * args.steps
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.reference = "embed-gloo" if "embed-gloo" in methods and "dense" not in methods else "dense"
    try:  # (a method none can run used to be refused once MPI had started; none ran nothing)
        check_methods(methods)
    except (ValueError, RuntimeError) as exc:
        ap.error(f"argument --methods: {exc}")

    import torch

    from sparsecoll import select
    from sparsecoll.integrations.torch import init_process_group

    torch.set_num_threads(args.threads)
    # one emulated host per rank, but they share this machine's cores: Numba's idle OpenMP
    # pool would spin on the cores the other ranks compute on (sparsecoll.select._numba_core)
    os.environ.setdefault("SPARSECOLL_NUM_THREADS", str(args.threads))
    comm = Communicator()
    # (rank 0 writes them, making the folder: checked now, not after the first method trained)
    refuse_unwritable(comm, [], [args.out_dir], parents=True)
    addr = None
    if args.iface:
        os.environ["GLOO_SOCKET_IFNAME"] = args.iface
        addr = rendezvous_address(comm, args.iface)
    # (the cache first: one rank that cannot write or read it stops every rank, before gloo)
    ids = load_corpus(comm, args.vocab, args.cache_dir)
    init_process_group(comm, addr=addr)
    select.warmup()
    n_params = sum(p.numel() for p in make_model(torch, args).parameters())
    if comm.rank == 0:
        print(f"# sparsecoll {sparsecoll.__version__} train_cluster: {mpi_library_version()}")
        print(
            f"# P={comm.size} torch={torch.__version__} threads={args.threads} "
            f"tokens={len(ids)} vocab={args.vocab} d_model={args.d_model} layers={args.layers} "
            f"context={args.context} batch/rank={args.batch} parameters={n_params} "
            f"optimizer={args.optimizer} lr={args.lr} density={args.density} "
            f"bucket_mb={args.bucket_mb} seed={args.seed}"
        )
        print(f"# load average at start (1/5/15 min, whole machine): {os.getloadavg()}")
        sys.stdout.flush()
    target, limit, compute_s, summary = args.target, None, None, {}
    for method in methods:
        rows = train(
            args, torch, comm, ids, method, target if method != args.reference else None, limit
        )
        if method == "compute":
            compute_s = float(np.median([r["step_s"] for r in rows[min(5, len(rows) // 4) :]]))
        if method == args.reference:
            target = target if target is not None else rows[-1]["eval_loss"]
            limit = rows[-1]["wall_s"] * args.time_factor
        summary[method] = summarize(rows, target, compute_s)
        if comm.rank == 0 and args.out_dir:
            args.out_dir.mkdir(parents=True, exist_ok=True)
            with open(args.out_dir / f"{method}.csv", "w", newline="") as f:
                w = csv.DictWriter(f, FIELDS)
                w.writeheader()
                w.writerows(rows)
    if comm.rank == 0:
        print(f"# load average at end (1/5/15 min, whole machine): {os.getloadavg()}")
        print_summary(summary, target)
    return 0


def print_summary(summary: dict, target: float | None) -> None:
    print(f"# target held-out loss: {target}")
    print(
        f"{'method':<16}{'steps':>7}{'step ms':>9}{'compute':>9}{'comm':>9}{'exposed':>9}"
        f"{'waited':>8}"
        f"{'final loss':>12}{'reach step':>12}{'reach s':>9}{'vs dense':>10}"
    )
    dense = summary.get("dense", summary.get("embed-gloo", {})).get("reach_wall")
    for m, s in summary.items():
        ms = lambda v: f"{v * 1e3:.0f}" if v is not None else "-"  # noqa: E731
        reach = s["reach_wall"]
        speed = f"{dense / reach:.2f}x" if dense and reach else "-"
        final = f"{s['final_eval']:.4f}" if s["final_eval"] is not None else "-"
        print(
            f"{m:<16}{s['steps']:>7}{ms(s['step_s']):>9}{ms(s['compute_s']):>9}"
            f"{ms(s['comm_s']):>9}{ms(s['exposed_s']):>9}{ms(s['wait_s']):>8}{final:>12}"
            f"{s['reach_step'] or '-':>12}{(f'{reach:.1f}' if reach else '-'):>9}{speed:>10}"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
