"""Convergence of real training with sparse gradient allreduce vs dense, under mpiexec.

Trains the same model from the same seeds for the same steps once per method, through
PyTorch DDP with sparsecoll's communication hook (one GradientReducer per bucket, error
feedback, one dense warm-up iteration for DDP's bucket rebuild), and writes a CSV row per
step: loss, evaluation (every --eval-every steps), achieved density, bytes per rank.

Tasks (data that ships offline):
  digits  scikit-learn's bundled 8x8 handwritten digits (1797 images): an MLP classifier,
          evaluated on a fixed held-out quarter (accuracy and loss);
  charlm  a character language model on the text of CPython's pydoc topics
          (``pydoc_data.topics``, ~465k characters): an MLP over the previous 16 characters,
          evaluated on the last 10% of the text (loss in nats per character).

Usage (rank 0 writes the CSV and prints the summary):
  mpiexec -n 4 python bench/convergence.py --task digits --out digits.csv
  python bench/plot_convergence.py digits.csv
Needs torch (and scikit-learn for digits).
"""

from __future__ import annotations

import csv
import sys
import time
from pathlib import Path

import numpy as np

import sparsecoll
from sparsecoll.comm import Communicator, mpi_library_version

METHODS = ("dense", "allgather", "gtopk", "oktopk", "exdyna")
# extra method names: a registered algorithm plus options
VARIANTS = {
    "exdyna-authors": ("exdyna", {"rule": "authors"}),
    "oktopk-paper": ("oktopk", {"rule": "paper"}),
}
MOMENTUM = 0.9
SETTLE, BAND = 5, (0.8, 1.25)  # density summary: steps after warm-up left out, K/k band
# period-2 verdict on K/k: lag-1 autocorrelation at most CYCLE_AC with a standard deviation of
# at least CYCLE_SPREAD (a constant or nearly constant K/k has no cycle to speak of)
CYCLE_AC, CYCLE_SPREAD = -0.5, 0.05
# A "+mc" suffix (e.g. "oktopk+mc") selects momentum correction (DGC): the reducer keeps the
# momentum (velocity accumulated before selection, masked where sent) and the optimizer none.


def method_setup(method: str) -> tuple[str, dict, float]:
    """``(algorithm, reducer options, optimizer momentum)`` for a method name."""
    base, mc = (method[:-3], True) if method.endswith("+mc") else (method, False)
    algorithm, options = VARIANTS.get(base, (base, {}))
    if mc:
        return algorithm, {**options, "momentum": MOMENTUM}, 0.0
    return algorithm, dict(options), MOMENTUM


FIELDS = (
    "task",
    "method",
    "step",
    "train_loss",
    "eval_loss",
    "eval_acc",
    "achieved_density",
    "bytes_sent",
    "bytes_sent_total",
    "seconds",
)


# -- data and models --------------------------------------------------------------------------
class Digits:
    """scikit-learn's digits: 75% train (sharded over ranks), 25% held out."""

    batch = 32

    def __init__(self, torch, seed: int, rank: int, size: int) -> None:
        from sklearn.datasets import load_digits

        d = load_digits()
        x = (d.data / 16.0).astype(np.float32)
        y = d.target.astype(np.int64)
        perm = np.random.default_rng(seed).permutation(len(y))
        cut = len(y) * 3 // 4
        tr, te = perm[:cut], perm[cut:]
        mine = tr[rank::size]
        self.torch = torch
        self.x, self.y = torch.from_numpy(x[mine]), torch.from_numpy(y[mine])
        self.xe, self.ye = torch.from_numpy(x[te]), torch.from_numpy(y[te])
        self.rng = np.random.default_rng([seed, rank])
        self.order, self.pos = self.rng.permutation(len(mine)), 0

    def model(self):
        nn = self.torch.nn
        return nn.Sequential(
            nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
        )

    def batch_xy(self):
        if self.pos + self.batch > len(self.order):
            self.order, self.pos = self.rng.permutation(len(self.order)), 0
        i = self.order[self.pos : self.pos + self.batch]
        self.pos += self.batch
        return self.x[i], self.y[i]

    def evaluate(self, model) -> tuple[float, float]:
        torch = self.torch
        with torch.no_grad():
            out = model(self.xe)
            loss = torch.nn.functional.cross_entropy(out, self.ye).item()
            acc = (out.argmax(1) == self.ye).float().mean().item()
        return loss, acc


class CharLM:
    """An MLP over the previous ``context`` characters of pydoc's topic texts."""

    batch = 64
    context = 16

    def __init__(self, torch, seed: int, rank: int, size: int) -> None:
        from pydoc_data.topics import topics

        text = "".join(topics[k] for k in sorted(topics))
        chars = sorted(set(text))
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        lut = {ord(c): i for i, c in enumerate(chars)}
        ids = np.array([lut[int(c)] for c in codes], dtype=np.int64)
        self.vocab = len(chars)
        cut = len(ids) * 9 // 10
        self.torch = torch
        self.train_ids = torch.from_numpy(ids[:cut])
        self.eval_ids = torch.from_numpy(ids[cut:])
        self.rng = np.random.default_rng([seed, rank])
        erng = np.random.default_rng(seed + 1)
        self.eval_pos = erng.integers(self.context, len(self.eval_ids), 4096)

    def model(self):
        nn = self.torch.nn
        return nn.Sequential(
            nn.Embedding(self.vocab, 16),
            nn.Flatten(),
            nn.Linear(16 * self.context, 128),
            nn.ReLU(),
            nn.Linear(128, 128),
            nn.ReLU(),
            nn.Linear(128, self.vocab),
        )

    def _windows(self, ids, pos):
        torch = self.torch
        offs = torch.arange(-self.context, 0)
        p = torch.from_numpy(np.asarray(pos))
        return ids[p[:, None] + offs], ids[p]

    def batch_xy(self):
        pos = self.rng.integers(self.context, len(self.train_ids), self.batch)
        return self._windows(self.train_ids, pos)

    def evaluate(self, model) -> tuple[float, float]:
        torch = self.torch
        x, y = self._windows(self.eval_ids, self.eval_pos)
        with torch.no_grad():
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out, y).item()
            acc = (out.argmax(1) == y).float().mean().item()
        return loss, acc


TASKS = {"digits": (Digits, 0.05), "charlm": (CharLM, 0.2)}  # task, default learning rate


# -- one run ---------------------------------------------------------------------------------
def train(args, torch, comm: Communicator, method: str) -> list[dict]:
    from torch.nn.parallel import DistributedDataParallel

    from sparsecoll.integrations.torch import SparseHookState, sparse_allreduce_hook

    algorithm, options, momentum = method_setup(method)
    task_cls, default_lr = TASKS[args.task]
    task = task_cls(torch, args.seed, comm.rank, comm.size)
    torch.manual_seed(args.seed)
    model = task.model()
    ddp = DistributedDataParallel(model)
    state = SparseHookState(comm, algorithm, density=args.density, warmup=args.warmup, **options)
    ddp.register_comm_hook(state, sparse_allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr or default_lr, momentum=momentum)
    sched = None
    if args.schedule == "cosine":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps)
    rows = []
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = task.batch_xy()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        train_loss = float(comm.allreduce(np.array([loss.item()]))[0]) / comm.size
        st = state.stats()
        row = {
            "task": args.task,
            "method": method,
            "step": step,
            "train_loss": train_loss,
            "eval_loss": "",
            "eval_acc": "",
            "achieved_density": st["achieved_density"],
            "bytes_sent": st["bytes_sent_last"],
            "bytes_sent_total": st["bytes_sent_total"],
            "seconds": time.perf_counter() - t0,
        }
        if step % args.eval_every == 0 or step == args.steps:
            row["eval_loss"], row["eval_acc"] = task.evaluate(model)
            if args.verbose and comm.rank == 0:
                print(
                    f"# {method} step {step}: train {train_loss:.4f} eval "
                    f"{row['eval_loss']:.4f} acc {row['eval_acc']:.4f} "
                    f"{row['seconds']:.1f}s",
                    file=sys.stderr,
                    flush=True,
                )
        rows.append(row)
    return rows


def ratio_stats(ratio: np.ndarray) -> dict:
    """K/k per step (after warm-up and SETTLE) summarized: min, max, mean, fraction in BAND,
    lag-1 autocorrelation (nan when K/k is constant, to rounding), std, and the period-2 verdict."""
    ratio = np.asarray(ratio, dtype=np.float64)
    if ratio.size == 0:
        ratio = np.ones(1)
    d = ratio - ratio.mean()
    var = float(np.mean(d * d))
    lag1 = float("nan")
    if ratio.size > 1 and var > 1e-18:
        lag1 = float(np.mean(d[1:] * d[:-1]) / var)
    std = var**0.5
    return {
        "ratio_min": float(ratio.min()),
        "ratio_max": float(ratio.max()),
        "ratio_mean": float(ratio.mean()),
        "ratio_std": std,
        "ratio_lag1": lag1,
        "in_band": float(np.mean((ratio >= BAND[0]) & (ratio <= BAND[1]))),
        "out_of_band_steps": int(np.count_nonzero((ratio < BAND[0]) | (ratio > BAND[1]))),
        "period2": bool(lag1 <= CYCLE_AC and std >= CYCLE_SPREAD),
    }


def step_ratios(rows: list[dict], warmup: int = 1, density: float = 0.01) -> np.ndarray:
    """Achieved / requested density per step, after the warm-up and SETTLE more steps."""
    return np.array([float(r["achieved_density"]) for r in rows[warmup + SETTLE :]]) / density


def summarize(rows: list[dict], n_last: int, warmup: int = 1, density: float = 0.01) -> dict:
    evals = [r for r in rows if r["eval_loss"] != ""]
    tail = evals[-n_last:]
    sparse = rows[warmup:]  # after the dense warm-up iterations
    return {
        **ratio_stats(step_ratios(rows, warmup, density)),
        "eval_loss": float(np.mean([r["eval_loss"] for r in tail])),
        "eval_acc": float(np.mean([r["eval_acc"] for r in tail])),
        "train_loss": float(np.mean([r["train_loss"] for r in rows[-50:]])),
        "density": float(np.mean([r["achieved_density"] for r in sparse])) if sparse else 1.0,
        "bytes": float(np.median([r["bytes_sent"] for r in sparse])) if sparse else 0.0,
        "total": rows[-1]["bytes_sent_total"],
        "seconds": rows[-1]["seconds"],
    }


def main(argv: list[str] | None = None) -> int:
    from sparsecoll.benchmarks.cli import (
        RankZeroParser,
        density_arg,
        float_arg,
        int_arg,
        refuse_unwritable,
        unknown_algorithm,
    )

    # (checked before MPI starts: a usage error exits 2 on every rank, printed once)
    ap = RankZeroParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=sorted(TASKS), default="digits")
    ap.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="comma-separated; a +mc suffix adds momentum correction (e.g. oktopk+mc)",
    )
    ap.add_argument("--density", type=density_arg, default=0.01)
    ap.add_argument("--steps", type=int_arg(1), default=600)
    ap.add_argument(
        "--warmup", type=int_arg(1), default=1, help="first iterations reduced densely (>= 1)"
    )
    ap.add_argument("--eval-every", type=int_arg(1), default=20)
    ap.add_argument("--lr", type=float_arg(0, above=True), default=None, help="default: per task")
    ap.add_argument("--schedule", choices=["cosine", "constant"], default="cosine")
    ap.add_argument("--seed", type=int_arg(0), default=0)
    ap.add_argument("--threads", type=int_arg(1), default=1, help="torch threads per rank")
    ap.add_argument("--out", type=Path, default=None, help="CSV file (rank 0)")
    ap.add_argument("-v", "--verbose", action="store_true", help="progress on stderr")
    args = ap.parse_args(argv)
    # (an unknown name, such as a typo, was skipped: the run went on without it, exit 0)
    known = sparsecoll.available_algorithms()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for method in methods:
        if method_setup(method)[0] not in known:
            names = [*known, *VARIANTS]
            error = unknown_algorithm(method.removesuffix("+mc"), names, "method")
            ap.error(f"argument --methods: {error} (each with an optional +mc)")
    if not methods:
        ap.error(f"argument --methods: expecting method names, got {args.methods!r}")

    import torch

    from sparsecoll.integrations.torch import init_process_group

    torch.set_num_threads(args.threads)
    comm = Communicator()
    # (rank 0 writes it, making its folder: checked now, not once every method has trained)
    refuse_unwritable(comm, [args.out], parents=True)
    init_process_group(comm)
    if comm.rank == 0:
        print(f"# sparsecoll {sparsecoll.__version__} convergence: {mpi_library_version()}")
        print(
            f"# task={args.task} P={comm.size} density={args.density} steps={args.steps} "
            f"lr={args.lr or TASKS[args.task][1]} schedule={args.schedule} seed={args.seed} "
            f"torch={torch.__version__} ({args.warmup} dense warm-up iteration(s), then error "
            "feedback)"
        )
    all_rows, summary = [], {}
    for method in methods:
        rows = train(args, torch, comm, method)
        all_rows += rows
        summary[method] = summarize(rows, 3, args.warmup, args.density)
    if comm.rank == 0:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "w", newline="") as f:
                w = csv.DictWriter(f, FIELDS)
                w.writeheader()
                w.writerows(all_rows)
        dense = summary.get("dense")
        print(
            f"{'method':<16}{'eval acc':>10}{'eval loss':>11}{'vs dense':>10}{'train loss':>12}"
            f"{'density':>9}{'bytes/rank/step':>17}{'total MB':>10}{'seconds':>9}"
            f"{'K/k min':>9}{'K/k max':>9}{'K/k mean':>9}{'in band':>9}{'lag-1':>7}"
        )
        for m, s in summary.items():
            rel = f"{s['eval_loss'] / dense['eval_loss'] - 1:+.1%}" if dense else "-"
            print(
                f"{m:<16}{s['eval_acc'] * 100:>9.2f}%{s['eval_loss']:>11.4f}{rel:>10}"
                f"{s['train_loss']:>12.4f}{s['density']:>9.4f}{s['bytes']:>17.0f}"
                f"{s['total'] / 1e6:>10.2f}{s['seconds']:>9.1f}"
                + (
                    f"{'-':>9}{'-':>9}{'-':>9}{'-':>9}{'-':>7}"
                    if m == "dense"
                    else f"{s['ratio_min']:>9.3f}{s['ratio_max']:>9.3f}{s['ratio_mean']:>9.3f}"
                    f"{s['in_band']:>9.1%}"
                    + ("      -" if np.isnan(s["ratio_lag1"]) else f"{s['ratio_lag1']:>7.2f}")
                )
            )
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
