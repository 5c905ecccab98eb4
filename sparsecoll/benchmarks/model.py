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
  (docs/selecting.md, "At large P"), so at large P and small k S understates them.

Formulas (per rank, max over ranks; lg = ⌈log2 P⌉, p = 2^⌊log2 P⌋, f = 1 when P ≠ p else 0,
K(m) = expected size of the union of m ranks' index sets under the overlap pattern, e.g.
n·(1 − (1 − k/n)^m) for ``random``; sp(m, L) = min(m·pair, L·v), the break-even switch):

=================== =================================================== =========================
algorithm           S(P) bytes sent                                     M(P) messages
=================== =================================================== =========================
dense               2(P−1)/P·n·max(v, 4)                                2·lg
rabenseifner        2(p−1)/p·n·v + f·n·v                                2·log2 p + f
allgather           (P−1)·k·pair                                        2·lg
dsa                 (P−1)·sp(k/P, n/P) + (P−1)/P·sp(K(P), n)            (P−1)(1 + c) + lg + w·g
recursive_doubling  Σ_{i<log2 p} sp(K(2^i + r_i), n) + f·sp(K(P), n)    2·log2 p + 3f
gtopk               log2 p·k·pair + f·(k·pair + k/8)                    log2 p + 2f
oktopk              2·k(P−1)/P·pair                                     2(P−1) + 2·lg + 1
exdyna              k(P−1)/P·(i + 2v)                                   4·lg
=================== =================================================== =========================

dsa's messages: c (a reduce-scatter chunk of k/P entries) and g (a gathered range of K(P)/P)
are 2 while they travel sparse (indices, values) and 1 once dense; w is the pieces rank P−1
sends over Bruck's ⌈log2 P⌉ rounds (one a round, two where its run of min(2^i, P−2^i) > 1
ranges wraps past P−1). recursive_doubling's busiest rank is the power-of-two group's rank 0:
entering round i it holds its 2^i lowest members' inputs, of which r_i = min(2^i, P−p) include
a folded partner's.

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
import math
from collections.abc import Callable, Iterable
from typing import Any

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
    """The shape of one call: dense length, nonzeros per rank, byte sizes, overlap."""

    n: int
    k: int
    index_bytes: int = 4
    value_bytes: int = 4
    overlap: str = "random"

    @property
    def pair(self) -> int:
        return self.index_bytes + self.value_bytes

    def sp(self, m: float, length: float) -> float:
        """Bytes of m entries of a range of ``length``: sparse or dense, whichever is smaller."""
        return min(m * self.pair, length * self.value_bytes)

    def sparse(self, m: float, length: float) -> bool:
        """Whether m entries of a range of ``length`` travel sparse (the break-even rule)."""
        return m * self.pair < length * self.value_bytes

    def union(self, m: float) -> float:
        return union_size(self.n, self.k, m, self.overlap)


def union_size(n: int, k: int, m: float, overlap: str = "random") -> float:
    """Expected number of distinct indices in the union of m ranks' inputs (make_problem)."""
    if m <= 0 or k <= 0:
        return 0.0
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


def _dsa(P: int, x: Problem) -> Counts:
    s = (P - 1) * x.sp(x.k / P, x.n / P) + (P - 1) / P * x.sp(x.union(P), x.n)
    # a chunk or range travels as indices + values while sparse, as one message when dense;
    # the counts' alltoall (P - 1) and allgather (lg); Bruck's rounds: rank P - 1 sends a
    # run of ranges that wraps past P - 1 (two pieces) whenever the run is longer than one
    chunk = 1 + x.sparse(x.k / P, x.n / P)
    gathered = 1 + x.sparse(x.union(P) / P, x.n / P)
    pieces = sum(1 if c == 1 else 2 for c in _bruck_counts(P))
    return Counts(s, (P - 1) * (chunk + 1) + _lg(P) + pieces * gathered)


def _bruck_counts(P: int) -> list[int]:
    """Ranges each rank sends in each round of dsa's Bruck allgather."""
    return [min(2**i, P - 2**i) for i in range(_lg(P))]


def _recursive_doubling(P: int, x: Problem) -> Counts:
    p, f = _pof2(P)
    lgp = p.bit_length() - 1
    # the busiest rank is newrank 0: entering round i it holds the 2^i newranks below 2^i,
    # and the first P - p of them took a folded partner's input each
    r = P - p
    s = sum(x.sp(x.union(2**i + min(2**i, r)), x.n) for i in range(lgp)) + f * x.sp(x.union(P), x.n)
    return Counts(s, 2 * lgp + 3 * f)


def _gtopk(P: int, x: Problem) -> Counts:
    p, f = _pof2(P)
    lgp = p.bit_length() - 1
    return Counts(lgp * x.k * x.pair + f * (x.k * x.pair + x.k / 8), lgp + 2 * f)


def _oktopk(P: int, x: Problem) -> Counts:
    return Counts(2 * x.k * (P - 1) / P * x.pair, 2 * (P - 1) + 2 * _lg(P) + int(P > 1))


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
