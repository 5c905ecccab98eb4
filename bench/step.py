"""Training-step benchmark: ``GradientReducer.step`` on a dense gradient, every algorithm.

What one data-parallel training step pays for gradient exchange: error feedback, selection
and the collective, from a dense gradient to the dense update (``step(grad, out=update)``,
the update buffer reused as a training loop does). Per algorithm it reports the median step
time (max over ranks per step, as OSU does) split into local work and communication (the
reducer times its collective call; local = step − collective), bytes sent per rank, the
achieved density per step (result nnz / k), the minor page faults of a step (fresh memory
that a step touches costs one per 4 KiB), the step time over one ``np.add(a, b, out=c)`` of
two n-arrays (the memory floor of the pass) and the speed-up over the dense allreduce step.

Gradients: a stream of Gaussian vectors with a linear scale profile
(``N(0, 1)·linspace(0.2, 2, n)``): ``--grads`` of them cycled (drawing a fresh 16M-vector
costs more than a step), stationary or decaying 10% per step; ``--stream fresh``, a new one
every step (one of ``--grads`` N(0, 1) vectors shifted by a random offset, then scaled: no
index sees the same value twice, so with a long ``--warmup`` the residual settles as in a
training run instead of growing with the cycle); or, with ``--rows R``, an embedding's
gradient: R random rows of 256 entries nonzero per rank (fewer than k nonzeros in all when
R·256·P < density·n).

    mpiexec -n 4 python bench/step.py -m 16M                  # every algorithm, 1%
    SPARSECOLL_NUM_THREADS=1 python bench/step.py -m 16M      # P = 1, one thread
    SPARSECOLL_NUM_THREADS=1 python bench/step.py -m 16M --update reuse   # O(k) update
    SPARSECOLL_NUM_THREADS=1 python bench/step.py -m 16M --stream fresh -x 200   # settled
    mpiexec -n 4 python bench/step.py -m 1M --stream decay -i 40 --csv out.csv --plot out.png
    mpiexec -n 4 python bench/step.py -m 8M --rows 64      # a 32768 x 256 embedding's gradient
"""

from __future__ import annotations

import argparse
import cProfile
import csv
import pstats
import resource
import sys
import time

import numpy as np

ALGORITHMS = ("dense", "allgather", "gtopk", "oktopk", "exdyna")
COLUMNS = (
    "algorithm", "P", "n", "step", "time_s", "cpu_s", "local_s", "comm_s", "nnz", "k",
    "bytes_sent", "faults", "full_topk", "add_s", "add_cpu_s",
)  # fmt: skip


def gradients(
    n: int, rank: int, count: int, seed: int, rows: int = 0, width: int = 256, scaled=True
) -> list[np.ndarray]:
    """``count`` gradients of the stationary stream for this rank (cycled by the timing
    loop: drawing a fresh 16M-vector costs more than a step). ``rows``: an embedding's
    gradient instead, ``rows`` random rows of ``width`` entries nonzero (N(0, 1)), the rest 0.
    ``scaled=False``: N(0, 1) without the scale profile (:class:`Fresh` scales them)."""
    rng = np.random.default_rng([seed, rank])
    if rows:
        out = []
        for _ in range(count):
            g = np.zeros(n, np.float32)
            for r in rng.integers(0, max(n // width, 1), rows):
                g[r * width : (r + 1) * width] = rng.standard_normal(width, dtype=np.float32)
            out.append(g)
        return out
    scale = np.linspace(0.2, 2.0, n, dtype=np.float32) if scaled else np.float32(1)
    return [rng.standard_normal(n, dtype=np.float32) * scale for _ in range(count)]


class Fresh:
    """A new gradient every step: one of the N(0, 1) ``bases`` circularly shifted by a
    random offset (the same for step ``it`` in every run), times the scale profile (two
    passes, outside the timed region)."""

    def __init__(self, bases: list[np.ndarray], rank: int, seed: int) -> None:
        n = bases[0].shape[0]
        self.bases, self.buf = bases, np.empty(n, np.float32)
        self.scale = np.linspace(0.2, 2.0, n, dtype=np.float32)
        self.seed = [seed, rank]

    def step(self, it: int) -> np.ndarray:
        base, n = self.bases[it % len(self.bases)], self.buf.shape[0]
        s = int(np.random.default_rng([*self.seed, it]).integers(0, n))
        np.multiply(base[s:], self.scale[: n - s], out=self.buf[: n - s])
        np.multiply(base[:s], self.scale[n - s :], out=self.buf[n - s :])
        return self.buf


class Adder:
    """One ``np.add(a, b, out=c)`` of two float32 n-arrays, timed (wall and CPU seconds):
    the reference a step is compared with, timed before every step so that both see the
    same memory speed (on a shared VM it drifts by 10-20% within a minute)."""

    def __init__(self, n: int) -> None:
        self.a = np.ones(n, np.float32)
        self.b = np.ones(n, np.float32)
        self.c = np.empty(n, np.float32)
        self.once()  # the first touch of c's pages

    def once(self) -> tuple[float, float]:
        t, u = time.perf_counter(), time.process_time()
        np.add(self.a, self.b, out=self.c)
        return time.perf_counter() - t, time.process_time() - u


def run(
    comm, name: str, args: argparse.Namespace, grads: list[np.ndarray] | Fresh, adder: Adder,
    profiler=None,
) -> list[dict]:  # fmt: skip
    from sparsecoll import GradientReducer

    reuse = args.update == "reuse"
    red = GradientReducer(comm, args.size, name, args.density, reuse_update=reuse)
    update = np.empty(args.size, np.float32)
    rows = []
    full = 0  # the reducer's count of exact top-k steps over all of acc, so far
    for it in range(args.warmup + args.iterations):
        g = grads.step(it) if isinstance(grads, Fresh) else grads[it % len(grads)]
        if args.stream == "decay":
            g = g * np.float32(0.9 ** (it % 60))  # outside the timed region
        if args.update == "inplace":  # the gradient buffer becomes the update (DDP's hook)
            np.copyto(update, g)  # outside the timed region
            g = update
        add_wall, add_cpu = adder.once()
        comm.barrier()
        timed = it >= args.warmup and profiler is not None
        if timed:
            profiler.enable()
        f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t, u = time.perf_counter(), time.process_time()
        if reuse:
            red.step(g)
        else:
            red.step(g, out=update)
        elapsed, cpu = time.perf_counter() - t, time.process_time() - u
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f
        if timed:
            profiler.disable()
        st = red.stats()
        mine = [elapsed, st["time_collective_s"], cpu, faults, st.get("full_topk_steps", 0) - full]
        mine += [add_wall, add_cpu]
        full = st.get("full_topk_steps", 0)  # (older versions: absent)
        worst = comm.allreduce_floats(mine, "max")
        if it >= args.warmup:
            rows.append(
                {
                    "algorithm": name,
                    "P": comm.size,
                    "n": args.size,
                    "step": it - args.warmup,
                    "time_s": float(worst[0]),
                    "cpu_s": float(worst[2]),
                    "local_s": float(worst[0] - worst[1]),
                    "comm_s": float(worst[1]),
                    "nnz": round(st["achieved_density"] * args.size),
                    "k": red.k,
                    "bytes_sent": st["bytes_sent"],
                    "faults": int(worst[3]),
                    "full_topk": int(worst[4]),
                    "add_s": float(worst[5]),
                    "add_cpu_s": float(worst[6]),
                }
            )
    return rows


def summarize(rows: list[dict], dense: float | None) -> dict:
    t = np.array([r["time_s"] for r in rows])
    floor = (np.median([r["add_s"] for r in rows]), np.median([r["add_cpu_s"] for r in rows]))
    cpu = float(np.median([r["cpu_s"] for r in rows]))
    ratio = np.array([r["nnz"] / r["k"] for r in rows]) if rows[0]["k"] else np.ones(1)
    med = float(np.median(t))
    return {
        "median_ms": med * 1e3,
        "add_ms": float(floor[0]) * 1e3,
        "min_ms": float(t.min()) * 1e3,
        "local_ms": float(np.median([r["local_s"] for r in rows])) * 1e3,
        "comm_ms": float(np.median([r["comm_s"] for r in rows])) * 1e3,
        "x_add": med / floor[0],
        "cpu_ms": cpu * 1e3,
        "x_add_cpu": cpu / floor[1],
        "vs_dense": (dense / med) if dense else float("nan"),
        "bytes": int(np.median([r["bytes_sent"] for r in rows])),
        "faults": int(np.median([r["faults"] for r in rows])),
        "full_topk": sum(r["full_topk"] for r in rows),
        "dens_min": float(ratio.min()),
        "dens_mean": float(ratio.mean()),
        "dens_max": float(ratio.max()),
    }


def plot(rows: list[dict], summary: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    loc = [summary[a]["local_ms"] for a in names]
    com = [summary[a]["comm_ms"] for a in names]
    ax1.bar(names, loc, label="local work")
    ax1.bar(names, com, bottom=loc, label="collective")
    ax1.set_ylabel("median step time (ms)")
    ax1.legend()
    for a in names:
        if a == "dense":
            continue
        pts = [(r["step"], r["nnz"] / r["k"]) for r in rows if r["algorithm"] == a]
        ax2.plot(*zip(*pts), label=a, marker=".")
    ax2.axhspan(0.8, 1.25, color="0.9", zorder=0)
    ax2.set_xlabel("step")
    ax2.set_ylabel("result nnz / k")
    ax2.legend()
    p, n = rows[0]["P"], rows[0]["n"]
    fig.suptitle(f"GradientReducer.step, P = {p}, n = {n:,}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_profile(name: str, prof: cProfile.Profile, top: int, steps: int) -> None:
    """The ``top`` functions by time of their own (ms per step), as cProfile measured it."""
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]  # type: ignore[attr-defined]
    print(f"# {name}: cProfile of the timed steps, ms per step (own time, with callees), calls")
    for (path, line, func), (_, calls, own, total, _) in rows:
        where = f"{path.rsplit('/', 1)[-1]}:{line}({func})"
        print(f"#   {own / steps * 1e3:8.2f} {total / steps * 1e3:8.2f} {calls:6d}  {where}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, every one checked before MPI starts or anything is allocated: a usage
    error exits 2 on every rank alike, printed once (rank 0). A density out of (0, 1], an
    unknown algorithm, -i 0, --grads 0 or --width 0 used to end in a traceback on every rank
    (after the earlier algorithms had run, for an unknown one); -m 16X in a ValueError one."""
    from sparsecoll import available_algorithms
    from sparsecoll.benchmarks.cli import (
        SIZE_HELP,
        RankZeroParser,
        add_timing_arguments,
        check_memory,
        density_arg,
        int_arg,
        local_ranks,
        parse_algorithms,
        size_arg,
    )

    ap = RankZeroParser(description=__doc__.split("\n\n")[0], epilog=SIZE_HELP)
    ap.add_argument(
        "-m", "--size", type=size_arg, default="16M", help="gradient length n (K/M/G suffixes)"
    )
    ap.add_argument("--density", type=density_arg, default=0.01)
    ap.add_argument(
        "--algorithms", default=",".join(ALGORITHMS), help="comma list, or 'all' (registered)"
    )
    add_timing_arguments(ap, 20, 5, timed="timed steps", untimed="untimed steps first")
    ap.add_argument("--stream", choices=("stationary", "decay", "fresh"), default="stationary")
    ap.add_argument("--grads", type=int_arg(1), default=4, help="distinct gradients cycled")
    ap.add_argument("--seed", type=int_arg(0), default=0)
    ap.add_argument(
        "--rows",
        type=int_arg(0),
        default=0,
        help="an embedding's gradient: this many random rows of --width entries per rank "
        "per step are nonzero, the rest 0 (default: the dense stream)",
    )
    ap.add_argument("--width", type=int_arg(1), default=256, help="row width for --rows")
    ap.add_argument(
        "--update",
        choices=("out", "inplace", "reuse"),
        default="out",
        help="where the update goes: out= a separate buffer (default), the gradient's own "
        "buffer (step(g, out=g), as the DDP hooks do), or the reducer's reused buffer "
        "(reuse_update=True: O(k) writes)",
    )
    ap.add_argument(
        "--profile",
        type=int_arg(0),
        default=0,
        metavar="N",
        help="after the table, rank 0's cProfile of the timed steps: the N functions with the "
        "most time of their own, per algorithm, per step",
    )
    ap.add_argument("--csv", help="write every step's row here")
    ap.add_argument("--plot", help="write a PNG here (matplotlib)")
    args = ap.parse_args(argv)
    try:  # (duplicates run once: the table has a row per algorithm)
        args.algorithms = parse_algorithms(
            [args.algorithms], available_algorithms(), "--algorithms"
        )
    except ValueError as exc:
        ap.error(str(exc))
    if args.rows and args.width > args.size:
        ap.error(f"expecting --width <= n, got --width {args.width} for n = {args.size}")
    # the cycled gradients, the update, np.add's three arrays: float32 n-vectors per rank
    arrays = args.grads + 4
    what = f"{arrays} float32 n-vectors (--grads {args.grads}, the update, np.add's three)"
    check_memory(ap, args.size, 4 * arrays, local_ranks(1), what)
    return args


def main(argv: list[str] | None = None) -> None:
    from sparsecoll import Communicator, __version__, select
    from sparsecoll.benchmarks.cli import refuse_unwritable

    args = parse_args(argv)
    comm = Communicator()
    refuse_unwritable(comm, [args.csv, args.plot])  # now, not after the whole run
    select.warmup(parallel=True)
    fresh = args.stream == "fresh" and not args.rows
    grads = gradients(
        args.size, comm.rank, args.grads, args.seed, args.rows, args.width, scaled=not fresh
    )
    if fresh:
        grads = Fresh(grads, comm.rank, args.seed)
    adder = Adder(args.size)
    rows, summary = [], {}
    names = args.algorithms
    profiles = {}
    for name in names:
        profiles[name] = cProfile.Profile() if args.profile and comm.rank == 0 else None
        mine = run(comm, name, args, grads, adder, profiles[name])
        rows += mine
        dense = summary["dense"]["median_ms"] / 1e3 if "dense" in summary else None
        summary[name] = summarize(mine, dense)
        if name == "dense":  # (the reference itself)
            summary[name]["vs_dense"] = 1.0
    if comm.rank:
        return
    print(f"# sparsecoll {__version__} training-step benchmark (GradientReducer.step)")
    print(
        f"# P = {comm.size}, n = {args.size:,} float32, density {args.density}, "
        f"stream {args.stream}, {args.iterations} steps after {args.warmup} warm-up, "
        f"selection threads {select.get_num_threads()}, update {args.update}"
    )
    add = [r["add_s"] for r in rows]
    add_cpu = [r["add_cpu_s"] for r in rows]
    print(
        f"# np.add(a, b, out=c) of two n-arrays, timed before every step: "
        f"{np.median(add) * 1e3:.2f} ms, {np.median(add_cpu) * 1e3:.2f} ms CPU (medians; "
        f"{np.min(add) * 1e3:.2f}-{np.max(add) * 1e3:.2f} ms)"
    )
    print("# times: median over steps of the max over ranks; add ms: np.add before the steps;")
    print("# x add: step / np.add (medians over the same steps);")
    print("# cpu: process CPU time of the step (robust to other load on a shared machine);")
    print("# vs dense: dense step / step; density: result nnz / k (min mean max);")
    print("# faults: minor page faults in a step (median over steps of the max over ranks);")
    print("# full: timed steps whose exact top-k read all of acc (its predicted cut missed)")
    head = (
        f"{'algorithm':<10}{'median ms':>10}{'min ms':>9}{'local ms':>10}{'comm ms':>9}"
        f"{'add ms':>8}{'x add':>7}{'cpu ms':>8}{'x add cpu':>10}{'vs dense':>9}{'bytes/rank':>12}"
        f"{'density':>20}{'faults':>8}{'full':>6}"
    )
    print(head)
    for name, s in summary.items():
        dens = f"{s['dens_min']:.2f} {s['dens_mean']:.2f} {s['dens_max']:.2f}"
        dens = "-" if name == "dense" else dens
        print(
            f"{name:<10}{s['median_ms']:>10.2f}{s['min_ms']:>9.2f}{s['local_ms']:>10.2f}"
            f"{s['comm_ms']:>9.2f}{s['add_ms']:>8.2f}{s['x_add']:>7.2f}{s['cpu_ms']:>8.2f}{s['x_add_cpu']:>10.2f}"
            f"{s['vs_dense']:>9.2f}{s['bytes']:>12,}"
            f"{dens:>20}{s['faults']:>8,}{s['full_topk']:>6}"
        )
    for name, prof in profiles.items():
        if prof is not None:
            print_profile(name, prof, args.profile, args.iterations)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(rows)
    if args.plot:
        plot(rows, summary, args.plot)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
