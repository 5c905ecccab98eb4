"""An α-β (latency-bandwidth) cost model of each algorithm, projected to large P.

For one call on P ranks (dense length n, k nonzeros per rank, ``pair`` = index + value
bytes, ``v`` = value bytes), a rank's time is modelled as

    T(P) = α·M(P) + S(P)/B + C(P)

* α (s per message) and B (bytes/s) describe the link (:data:`LINKS`, or measured);
* M(P): messages a rank sends (payload + metadata), S(P): payload bytes it sends, both taken
  from the Communicator's counters where measured, and beyond that from the per-algorithm
  formulas below, scaled by ``measured / formula`` at the largest measured P (the factor is
  printed: 1.00 means the formula matches the counters exactly);
* C(P): local work (coalescing, merging, densifying), ``c0 + c1·R(P)`` with R(P) the bytes a
  rank receives; c0 and c1 are fitted per algorithm to shared-memory runs at P = 1 and 2
  (one rank per core, nothing oversubscribed). Metadata bytes (counts, thresholds: < 1% of
  the payload at P <= 8 here) are left out of S; oktopk's and exdyna's grow with P
  (docs/guide/algorithms.md, "At large P"), so at large P and small k S understates them.

Formulas (per rank, max over ranks; lg = ⌈log2 P⌉, p = 2^⌊log2 P⌋, f = 1 when P ≠ p else 0,
K(m) = expected size of the union of m ranks' index sets under the overlap pattern, e.g.
n·(1 − (1 − k/n)^m) for ``random``; sp(m, L) = min(m·pair, L·v), the break-even switch):

=================== =================================================== =========================
algorithm           S(P) bytes sent                                     M(P) messages
=================== =================================================== =========================
dense               2(P−1)/P·n·max(v, 4)                                2·lg
rabenseifner        2(p−1)/p·n·v + f·n·v                                2·log2 p + f
allgather           (P−1)·k·pair                                        2·lg
dsa                 max_r Σ_{j≠r} sp(c_rj, L_j) + Σ_d t_d·sp(K_r+d, L_r+d)  (below)
recursive_doubling  Σ_{i<log2 p} sp(K(2^i + r_i), n) + f·sp(K(P), n)    2·log2 p + 3f (+1 a
                                                                        pair message > 64 KiB)
gtopk               log2 p·k·pair + f·(k·pair + k/8)                    log2 p + 2f
oktopk              (k_out + k(P−1)/P)·pair                             (P−1)(1 + o) + 2·lg + 1
exdyna              k(P−1)/P·(i + 2v)                                   4·lg
=================== =================================================== =========================

dsa is counted range by range (:func:`range_nnz`): L_j is the length of range j (split as
``j·n // P``), c_rj rank r's expected nonzeros in it and K_j the expected size of the ranks'
union there, both from the overlap pattern. In Bruck's round i rank r sends the ranges
r … r + cnt_i − 1 (mod P), cnt_i = min(2^i, P − 2^i), so range r + d goes t_d = #{i : d < cnt_i}
times: the owner sends its own range in all lg rounds. With indices spread evenly (random,
same) that is (P−1)·sp(k/P, n/P) + (P−1)/P·sp(K(P), n); under ``skewed`` the hot range's
owner sends the heaviest range lg times, and under ``disjoint`` every rank's indices lie in
its own range, so it reduce-scatters nothing. Messages, max over ranks: a nonempty chunk is
2 while sparse (indices, values) and 1 once dense; a run of ranges is one message of indices
(if a range in it travels sparse and nonempty) and one of values, twice that where it wraps
past P − 1; plus the counts' alltoall (P − 1) and the allgather of the owners' nnz (lg).
Under ``disjoint`` these are exact; otherwise they are expectations, and the busiest rank
sits above them by the spread of the draws (docs/reports/benchmarks.md §3).

oktopk: k_out = k(P−1)/P entries outside a rank's own region and o = 1 when the ranks draw
alike (the balanced regions hold an equal share of every rank's), k_out = o = 0 under
``disjoint``, where the regions fall on the ranks' slices (a few entries near a boundary
still cross: measured within 3% in bytes and one message, docs/reports/benchmarks.md §3).

recursive_doubling's busiest rank is the power-of-two group's rank 0: entering round i it
holds its 2^i lowest members' inputs, of which r_i = min(2^i, P−p) include a folded
partner's.

The formulas describe the steady state of stateful algorithms (the suite's ``--reuse``, as in
training): oktopk reusing its threshold and regions, exdyna its threshold window. A fresh
instance per call costs more metadata: oktopk recomputes its threshold (a radix select, one
histogram allreduce per value byte) and its regions, +9·lg messages; exdyna re-derives its
threshold, +2·lg messages and +2k(P−1)/P·v bytes. The calibration factors absorb that.
Messages include each algorithm's metadata (count exchanges; an alltoall counts P−1). The
input check every call makes before it (one small allreduce, 2·lg messages, outside the
counted window) is added to M when timing: :func:`check_messages`. ``auto`` is projected
as the best of the exact algorithms it chooses from, at each P (an ideal choice; the real
rule may differ). Algorithms without a formula are not projected.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..algorithms.base import range_bounds
from ..algorithms.dsa import bruck_counts
from ..algorithms.recursive_doubling import PACK_LIMIT
from .problems import HOT_SHARE, weights

__all__ = [
    "FORMULAS",
    "LINKS",
    "OSU_COLUMNS",
    "Calibrated",
    "Counts",
    "Link",
    "Problem",
    "calibrate",
    "check_messages",
    "range_nnz",
    "read_rows",
    "union_size",
]


@dataclasses.dataclass(frozen=True)
class Link:
    """Per-message latency α (s) and bandwidth B (bytes/s) of one rank's link."""

    name: str
    alpha: float
    bandwidth: float

    def time(self, messages: float, nbytes: float) -> float:
        return self.alpha * messages + nbytes / self.bandwidth


# Nominal figures: 1 GbE (TCP, commodity switch), EDR/HDR100 InfiniBand, Cray Aries
# (per-node injection bandwidth, MPI small-message latency).
LINKS = {
    "1gbe": Link("1 Gbit/s Ethernet", 50e-6, 125e6),
    "ib100": Link("100 Gbit/s InfiniBand", 1.5e-6, 12.5e9),
    "aries": Link("Cray Aries", 1.5e-6, 10e9),
}


@dataclasses.dataclass(frozen=True)
class Problem:
    """The shape of one call: dense length, nonzeros per rank, byte sizes, overlap, and the
    ranks the inputs were drawn for (``hot`` needs it: its hot range is the first 1/ranks)."""

    n: int
    k: int
    index_bytes: int = 4
    value_bytes: int = 4
    overlap: str = "random"
    ranks: int = 0

    def __post_init__(self) -> None:
        if self.overlap == "hot" and self.ranks < 1:
            raise ValueError("overlap 'hot' needs the ranks its inputs were drawn for (ranks=P)")

    @property
    def pair(self) -> int:
        return self.index_bytes + self.value_bytes

    def sp(self, m: float, length: float) -> float:
        """Bytes of m entries of a range of ``length``: sparse or dense, whichever is smaller."""
        return min(m * self.pair, length * self.value_bytes)

    def union(self, m: float) -> float:
        return union_size(self.n, self.k, m, self.overlap, self.ranks)


def _hot_segments(n: int, k: int, ranks: int) -> list[tuple[int, int, int]]:
    """(start, end, count) of make_problem's ``hot`` draws."""
    hot = max(1, n // ranks)
    k_rest = min(k - min(round(HOT_SHARE * k), hot), n - hot)
    return [(0, hot, min(k - k_rest, hot)), (hot, n, k_rest)]


@functools.lru_cache(maxsize=8)
def _inclusion(overlap: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sample positions of [0, n), how many indices each stands for, and the probability
    π = 1 − exp(−t·w) that a rank holds one (Σ = k) under zipf or tokens.

    make_problem keeps the k smallest keys E/w (E exponential): for large n the k-th is a
    near-fixed cut t, and an index is kept when E < t·w. The first 2^16 indices are exact,
    the rest sampled at about 2^18 evenly spaced points (the weights vary slowly there).
    """
    head = min(n, 1 << 16)
    stride = max(1, -(-(n - head) // (1 << 18)))
    pos = np.concatenate([np.arange(head), np.arange(head, n, stride)])
    mult = np.diff(np.append(pos, n)).astype(np.float64)
    w = weights(overlap, n, pos)
    if k >= n:
        return pos, mult, np.ones_like(w)

    # Newton on the concave held(t) = Σ mult·(1 − e^−tw) from below stays below the root
    t = k / float(mult @ w)  # held(t) <= k, as 1 − e^−x <= x
    for _ in range(100):
        e = np.exp(-t * w)
        step = (k - float(mult @ -np.expm1(-t * w))) / float(mult @ (w * e))
        t += step
        if step <= 1e-12 * t:
            break
    return pos, mult, -np.expm1(-t * w)


def union_size(n: int, k: int, m: float, overlap: str = "random", ranks: int = 0) -> float:
    """Expected number of distinct indices in the union of m ranks' inputs (make_problem;
    ``ranks``: the P they were drawn for, which ``hot`` needs)."""
    if m <= 0 or k <= 0:
        return 0.0
    if overlap == "hot":
        if ranks < 1:
            raise ValueError("overlap 'hot' needs the ranks its inputs were drawn for")
        return sum(union_size(b - a, c, m) for a, b, c in _hot_segments(n, k, ranks) if b > a)
    if overlap in ("zipf", "tokens"):
        _, mult, pi = _inclusion(overlap, n, k)
        return float(mult @ -np.expm1(m * np.log1p(-np.minimum(pi, 1.0 - 1e-16))))
    if overlap == "same":
        return float(min(k, n))
    if overlap == "disjoint":
        return float(min(n, m * k))
    if overlap == "skewed":  # 90% of the indices in the first 10% of [0, n)
        hot = max(1, n // 10)
        k_hot = int(0.9 * k)
        return union_size(hot, k_hot, m) + union_size(n - hot, k - k_hot, m)
    if overlap != "random":
        raise ValueError(f"unknown overlap {overlap!r}")
    return n * -math.expm1(m * math.log1p(-min(k / n, 1.0))) if k < n else float(n)


@dataclasses.dataclass(frozen=True)
class Counts:
    """Bytes sent and messages sent (payload + metadata) per rank per call."""

    bytes: float
    messages: float


def _lg(P: int) -> int:
    return math.ceil(math.log2(P)) if P > 1 else 0


def _pof2(P: int) -> tuple[int, int]:
    p = 1 << (P.bit_length() - 1)
    return p, int(p != P)


def check_messages(P: int) -> int:
    """Messages of the input check ``sparsecoll.allreduce`` makes before every call."""
    return 2 * _lg(P)


def _dense(P: int, x: Problem) -> Counts:
    return Counts(2 * (P - 1) / P * x.n * max(x.value_bytes, 4), 2 * _lg(P))


def _rabenseifner(P: int, x: Problem) -> Counts:
    p, f = _pof2(P)
    lgp = p.bit_length() - 1
    return Counts(2 * (p - 1) / p * x.n * x.value_bytes + f * x.n * x.value_bytes, 2 * lgp + f)


def _allgather(P: int, x: Problem) -> Counts:
    return Counts((P - 1) * x.k * x.pair, 2 * _lg(P))


def range_nnz(x: Problem, P: int) -> tuple[np.ndarray, np.ndarray]:
    """Expected nonzeros of each rank in each of dsa's P ranges, and of the ranks' union there.

    Returns ``c`` (P × P: ``c[s, j]`` rank s's expected count in range j) and ``K`` (P: the
    expected size of the union of all P ranks' indices in range j), for make_problem's
    overlap pattern. Every pattern draws each rank's indices uniformly from a few segments
    of [0, n): ``random`` k of [0, n); ``same`` the same k for every rank; ``skewed`` 90% of
    k in the first 10% of n and the rest in the other 90%, independently per rank;
    ``disjoint`` k of rank s's own slice, which is dsa's range s (both split [0, n) as
    ``i·n // P``); ``hot`` 80% of k in the first 1/ranks of n. Within a segment a position
    is drawn with probability q = count/length, independently per rank, so the union holds
    it with probability 1 − (1 − q)^P; under ``zipf`` and ``tokens`` q is each index's
    inclusion probability π (:func:`_inclusion`).
    """
    bounds = range_bounds(x.n, P)
    lo, hi = bounds[:-1].astype(float), bounds[1:].astype(float)
    if x.overlap == "disjoint":
        # slice s is range s: rank s's min(k, L_s) indices all fall in its own range
        K = np.minimum(float(x.k), hi - lo)
        return np.diag(K), K
    if x.overlap in ("zipf", "tokens"):  # the same π for every rank
        pos, mult, pi = _inclusion(x.overlap, x.n, x.k)
        j = np.searchsorted(bounds, pos, side="right") - 1
        c = np.bincount(j, mult * pi, P)
        union = mult * -np.expm1(P * np.log1p(-np.minimum(pi, 1.0 - 1e-16)))
        return np.broadcast_to(c, (P, P)), np.bincount(j, union, P)
    if x.overlap in ("random", "same"):
        segments = [(0, x.n, min(x.k, x.n))]
    elif x.overlap == "skewed":
        hot, k_hot = max(1, x.n // 10), int(0.9 * x.k)
        segments = [(0, hot, min(k_hot, hot)), (hot, x.n, min(x.k - k_hot, x.n - hot))]
    elif x.overlap == "hot":
        segments = _hot_segments(x.n, x.k, x.ranks)
    else:
        raise ValueError(f"unknown overlap {x.overlap!r}")
    c = np.zeros(P)
    K = np.zeros(P)
    for a, b, count in segments:
        if b <= a or count <= 0:
            continue
        q = count / (b - a)
        inside = np.clip(np.minimum(hi, b) - np.maximum(lo, a), 0.0, None)
        c += inside * q
        if x.overlap == "same":
            K += inside * q
        else:
            K += inside * (1.0 if q >= 1 else -math.expm1(P * math.log1p(-q)))
    return np.broadcast_to(c, (P, P)), K


def _dsa(P: int, x: Problem) -> Counts:
    if P < 2:
        return Counts(0, 0)
    lengths = np.diff(range_bounds(x.n, P)).astype(float)
    c, K = range_nnz(x, P)
    ranks = np.arange(P)
    # step 2: rank r sends its chunk of every other range j, sparse or dense
    chunk = np.minimum(c * x.pair, lengths * x.value_bytes)
    chunk[ranks, ranks] = 0.0
    chunk_msgs = np.where(c > 0, np.where(c * x.pair < lengths * x.value_bytes, 2, 1), 0)
    chunk_msgs[ranks, ranks] = 0
    # step 3: in round i rank r sends ranges r .. r + cnt_i − 1 (mod P), so range r + d goes
    # times[d] = #{i : d < cnt_i} times; the owner of a heavy range sends it every round
    counts = bruck_counts(P)  # ranges each rank sends in each round
    times = np.array([sum(d < cnt for cnt in counts) for d in range(P)])
    block = np.minimum(K * x.pair, lengths * x.value_bytes)
    ahead = (ranks[:, None] + ranks[None, :]) % P  # ahead[r, d] = (r + d) mod P
    sent = chunk.sum(axis=1) + (block[ahead] * times).sum(axis=1)
    # messages: a chunk or range travels as indices + values while sparse, as values alone
    # once dense; a run of ranges is one message of each kind, two if it wraps past P − 1
    sparse = K * x.pair < lengths * x.value_bytes
    has_indices = sparse & (K > 0)
    has_values = (K > 0) | (~sparse & (lengths > 0))
    run_msgs = np.zeros(P)
    for cnt in counts:
        for r in range(P):
            spans = [(r, min(r + cnt, P))] + ([(0, r + cnt - P)] if r + cnt > P else [])
            for a, b in spans:
                run_msgs[r] += int(has_indices[a:b].any()) + int(has_values[a:b].any())
    msgs = chunk_msgs.sum(axis=1) + run_msgs
    # metadata: the counts' alltoall (P − 1) and the owners' nnz allgather (lg)
    return Counts(float(sent.max()), float(msgs.max()) + (P - 1) + _lg(P))


def _recursive_doubling(P: int, x: Problem) -> Counts:
    p, f = _pof2(P)
    lgp = p.bit_length() - 1
    # the busiest rank is newrank 0: entering round i it holds the 2^i newranks below 2^i,
    # and the first P - p of them took a folded partner's input each
    r = P - p
    held = [x.union(2**i + min(2**i, r)) for i in range(lgp)] + [x.union(P)] * f

    def messages(m: float) -> int:  # the size, then pairs packed up to PACK_LIMIT or split
        split = m * x.pair < x.n * x.value_bytes and m * x.pair > PACK_LIMIT
        return 2 + int(split)

    s = sum(x.sp(m, x.n) for m in held)
    return Counts(s, sum(messages(m) for m in held) + f)


def _gtopk(P: int, x: Problem) -> Counts:
    p, f = _pof2(P)
    lgp = p.bit_length() - 1
    return Counts(lgp * x.k * x.pair + f * (x.k * x.pair + x.k / 8), lgp + 2 * f)


def _oktopk(P: int, x: Problem) -> Counts:
    # step 3 sends a rank's entries outside its own region: the regions hold equal shares
    # of every rank's entries when the ranks draw alike, all of a rank's own when disjoint
    # (the balanced regions are its slice); step 5's allgatherv sends K(P - 1)/P, K = k
    outside = 0.0 if x.overlap == "disjoint" else x.k * (P - 1) / P
    chunks = 0 if x.overlap == "disjoint" else P - 1
    return Counts(
        (outside + x.k * (P - 1) / P) * x.pair, chunks + (P - 1) + 2 * _lg(P) + int(P > 1)
    )


def _exdyna(P: int, x: Problem) -> Counts:
    K = x.k  # the global selected count tracks k
    return Counts(K * (P - 1) / P * (x.index_bytes + 2 * x.value_bytes), 4 * _lg(P))


FORMULAS: dict[str, Callable[[int, Problem], Counts]] = {
    "dense": _dense,
    "rabenseifner": _rabenseifner,
    "allgather": _allgather,
    "dsa": _dsa,
    "recursive_doubling": _recursive_doubling,
    "gtopk": _gtopk,
    "oktopk": _oktopk,
    "exdyna": _exdyna,
}
AUTO_CANDIDATES = ("allgather", "dsa", "recursive_doubling", "dense")


_INTS = (
    "P",
    "n",
    "k",
    "iterations",
    "bytes_per_rank",
    "bytes_recv_per_rank",
    "messages_per_rank",
    "meta_bytes_per_rank",
    "meta_messages_per_rank",
    "result_nnz",
)
_FLOATS = ("density", "avg_us", "min_us", "max_us", "median_us")
OSU_COLUMNS = ("algorithm", "dtype", *_INTS, *_FLOATS)  # what :func:`read_rows` reads


def read_rows(paths: Iterable[str]) -> list[dict[str, Any]]:
    """Rows of the OSU suite's CSV files, numbers converted; rows with errors dropped.

    Files written before ``size_bytes`` existed get it from n and dtype. Their latency
    columns differ too: ``median_us`` was already over each call's slowest rank, but
    ``avg_us``/``min_us``/``max_us`` were over ranks of each rank's own mean (now all four
    are over the same per-call samples).
    """
    rows = []
    for path in paths:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                if r.get("error"):
                    continue
                for key in _INTS:
                    r[key] = int(r[key])
                for key in _FLOATS:
                    r[key] = float(r[key])
                if r.get("size_bytes"):
                    r["size_bytes"] = int(r["size_bytes"])
                else:
                    r["size_bytes"] = r["n"] * _ITEMSIZE[r["dtype"]]
                rows.append(r)
    return rows


_ITEMSIZE = {"float16": 2, "float32": 4, "float64": 8}


@dataclasses.dataclass
class Calibrated:
    """One algorithm's counts model, scaled to the Communicator's measurements."""

    name: str
    problem: Problem
    bytes_factor: float = 1.0
    messages_factor: float = 1.0
    recv_ratio: float = 1.0  # bytes received / bytes sent at the calibration P
    c0: float = 0.0  # local seconds per call with no communication
    c1: float = 0.0  # local seconds per byte received
    measured: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def counts(self, P: int) -> Counts:
        """Measured counts at a measured P, the scaled formula elsewhere."""
        if P in self.measured:
            r = self.measured[P]
            return Counts(r["bytes_per_rank"], r["messages_per_rank"] + r["meta_messages_per_rank"])
        c = FORMULAS[self.name](P, self.problem)
        return Counts(c.bytes * self.bytes_factor, c.messages * self.messages_factor)

    def compute(self, P: int) -> float:
        return self.c0 + self.c1 * self.counts(P).bytes * self.recv_ratio

    def time(self, P: int, link: Link, local: bool = True) -> float:
        """Projected seconds per call on ``link``, one rank per host; ``local=False`` leaves
        out C(P) (network time alone)."""
        c = self.counts(P)
        net = link.time(c.messages + check_messages(P), c.bytes) if P > 1 else 0.0
        return net + (self.compute(P) if local else 0.0)


def calibrate(name: str, problem: Problem, rows: list[dict[str, Any]]) -> Calibrated:
    """Fit one algorithm's model to measured rows (same n, density, overlap; any P).

    Byte and message factors come from the largest measured P > 1; c0 and c1 from the rows
    at P = 1 and P = 2 (local work with the least communication and no oversubscription).
    """
    if name not in FORMULAS:
        raise KeyError(f"no formula for algorithm {name!r}")
    mine = {r["P"]: r for r in rows if r["algorithm"] == name and r["n"] == problem.n}
    cal = Calibrated(name, problem, measured=mine)
    multi = [P for P in mine if P > 1]
    if multi:
        P0 = max(multi)
        r = mine[P0]
        f = FORMULAS[name](P0, problem)
        if f.bytes > 0 and r["bytes_per_rank"] > 0:
            cal.bytes_factor = r["bytes_per_rank"] / f.bytes
            cal.recv_ratio = r["bytes_recv_per_rank"] / r["bytes_per_rank"]
        total = r["messages_per_rank"] + r["meta_messages_per_rank"]
        if f.messages > 0 and total > 0:
            cal.messages_factor = total / f.messages
    t1 = mine[1]["median_us"] * 1e-6 if 1 in mine else 0.0
    cal.c0 = t1
    if 2 in mine and mine[2]["bytes_recv_per_rank"] > 0:
        cal.c1 = max(0.0, (mine[2]["median_us"] * 1e-6 - t1) / mine[2]["bytes_recv_per_rank"])
    return cal
