"""auto: pick the exact algorithm (allgather, dsa, recursive_doubling, dense) per call.

One small allreduce gives the global nnz N; with P, n and the index/value sizes it feeds a
latency–bandwidth–compute model (:func:`predict`, formulas in docs/guide/algorithms.md) and
the cheapest prediction runs (:func:`choose`; ties go to the earlier of ``CANDIDATES``;
P = 1 always gives allgather). The first call assumes independent uniform indices; each
later one uses the overlap exponent θ learned from the previous result (K(m) = k̄·m^θ).
N and the result are the same on every rank, so every rank makes the same choice; θ is
part of the signature, so use one instance per tensor on every rank.

When the pick may allocate O(n) (dense; recursive_doubling past its switch point), its
preflight runs and the ranks agree on it first: memory running out on one rank is a
CollectiveRuntimeError on every rank. Rows of D values count D values an index (``width``).
The default constants describe a cluster node pair
(5 µs, 10 GB/s); pass your own (``Auto(alpha=…, beta=…)``) to fit another machine. The
choice is in ``result.info["auto_choice"]``.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any, ClassVar

import numpy as np

from .. import _state
from .._agree import agreement
from .._array import index_dtype
from .._options import read_only, real
from ..comm import Communicator
from ..registry import algorithm_class, register_algorithm
from ..sparse import SparseVector
from .base import Algorithm, sparse_is_cheaper
from .dsa import bruck_counts

__all__ = ["CANDIDATES", "Auto", "CostModel", "choose", "predict", "union_size"]

CANDIDATES = ("allgather", "dsa", "recursive_doubling", "dense")


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Machine constants of the model (seconds)."""

    alpha: float = 5e-6  # per message
    beta: float = 1e-10  # per byte sent
    gamma_sort: float = 2e-8  # per pair and pass of a sort-based coalesce
    gamma_merge: float = 6e-9  # per pair of a linear two-run merge
    delta: float = 2e-9  # per element of a dense pass (zero, add, scan)


def union_size(m: float, n: int, kbar: float, theta: float | None) -> float:
    """Return the expected nnz of the sum of ``m`` inputs of ``kbar`` (θ None: uniform indices)."""
    if n <= 0 or kbar <= 0:
        return 0.0
    if theta is None:
        d = min(kbar / n, 1.0)
        return n if d >= 1.0 else n * -math.expm1(m * math.log1p(-d))
    return min(float(n), kbar * m**theta)


def dsa_messages(P: int) -> int:
    """Count the messages dsa's busiest rank (P − 1) sends while sparse.

    Chunks (indices and values) to P − 1 ranks, the counts' alltoall, the nnz allgather (lg),
    and per Bruck round its ranges as indices and values (two pieces each when they wrap).
    """
    rounds = bruck_counts(P)  # ⌈log2 P⌉ of them
    return 3 * (P - 1) + len(rounds) + sum(4 if cnt > 1 else 2 for cnt in rounds)


def predict(
    P: int,
    n: int,
    nnz_total: int,
    itype: Any,
    vtype: Any,
    theta: float | None = None,
    model: CostModel | None = None,
    width: int | None = None,
) -> dict[str, float]:
    """Return the predicted seconds of each candidate (formulas: docs/guide/algorithms.md);
    ``width``: rows of that many values an index (a dense pass covers n·D values)."""
    m = model or CostModel()
    d = width or 1
    isz, vsz = np.dtype(itype).itemsize, np.dtype(vtype).itemsize * d
    pair = isz + vsz
    N = float(nnz_total)
    kbar = N / P
    lg = math.ceil(math.log2(P)) if P > 1 else 0
    log2p = math.log2(P) if P > 1 else 0.0

    def sp(nnz: float, length: float) -> float:
        return min(nnz * pair, length * vsz)

    K = union_size(P, n, kbar, theta)
    out = {}
    out["allgather"] = (
        2 * lg * m.alpha + m.beta * (P - 1) / P * N * pair + m.gamma_sort * N * max(1.0, log2p)
    )
    out["dsa"] = (
        dsa_messages(P) * m.alpha
        + m.beta * (P - 1) * sp(kbar / P, n / P)
        + m.beta * (P - 1) / P * sp(K, n)
        + m.gamma_merge * kbar * max(1.0, log2p)
        + (m.delta * n * d if K * pair >= n * vsz else 0.0)
    )
    p = 1 << (P.bit_length() - 1)
    rd = (2 * (p.bit_length() - 1) + 3 * int(p != P)) * m.alpha
    group = P / p
    for _ in range(p.bit_length() - 1):
        rd += m.beta * sp(union_size(group, n, kbar, theta), n)
        rd += m.gamma_merge * union_size(2 * group, n, kbar, theta)
        group *= 2
    if K * pair >= n * vsz:
        rd += m.delta * n * d
    out["recursive_doubling"] = rd
    if n <= 4 * N:
        out["dense"] = 2 * lg * m.alpha + m.beta * 2 * (P - 1) / P * n * vsz + 3 * m.delta * n * d
    return out


def choose(
    P: int,
    n: int,
    nnz_total: int,
    itype: Any,
    vtype: Any,
    theta: float | None = None,
    model: CostModel | None = None,
    width: int | None = None,
) -> str:
    """Return the candidate with the smallest prediction (ties: earlier in ``CANDIDATES``)."""
    if P <= 1:
        return "allgather"
    cost = predict(P, n, nnz_total, itype, vtype, theta, model, width)
    return min((c for c in CANDIDATES if c in cost), key=lambda c: cost[c])


@register_algorithm
class Auto(Algorithm):
    """Exact: picks allgather, dsa, recursive_doubling or dense per call by a cost model.

    Args:
        alpha: seconds per message (the default: a cluster node pair).
        beta: seconds per byte sent (the default: 10 GB/s).
        gamma_sort: seconds per pair and pass of a sort-based coalesce.
        gamma_merge: seconds per pair of a linear two-run merge.
        delta: seconds per element of a dense pass (zero, add, scan).
    """

    name = "auto"
    takes_rows = True
    state_kinds: ClassVar[dict[str, _state.Kind] | None] = {"theta": _state.optional(_state.number)}
    fixed_options: ClassVar[tuple[str, ...]] = (
        "model", "alpha", "beta", "gamma_sort", "gamma_merge", "delta",
    )  # fmt: skip

    def __init__(
        self,
        alpha: float = CostModel.alpha,
        beta: float = CostModel.beta,
        gamma_sort: float = CostModel.gamma_sort,
        gamma_merge: float = CostModel.gamma_merge,
        delta: float = CostModel.delta,
    ) -> None:
        constants = dict(
            alpha=alpha, beta=beta, gamma_sort=gamma_sort, gamma_merge=gamma_merge, delta=delta
        )
        for k, v in constants.items():
            if not (math.isfinite(real(k, v)) and v >= 0):  # (real: TypeError for a str)
                raise ValueError(f"{k} must be a finite non-negative number, got {v!r}")
        self.model = CostModel(**{k: real(k, v) for k, v in constants.items()})
        self.reset()

    # the constants, read from the model: fixed at construction as the model is
    alpha = read_only("model.alpha", "alpha")
    beta = read_only("model.beta", "beta")
    gamma_sort = read_only("model.gamma_sort", "gamma_sort")
    gamma_merge = read_only("model.gamma_merge", "gamma_merge")
    delta = read_only("model.delta", "delta")

    def reset(self) -> None:
        """Forget the learned overlap (the next call assumes independent uniform indices)."""
        self.theta: float | None = None  # learned overlap exponent, None before a first call

    def signature(self) -> list[int]:
        # the constants and the learned state must agree, or ranks could choose differently
        return [zlib.crc32(repr((self.model, self.theta)).encode())]

    def reduce(self, comm: Communicator, x: SparseVector) -> SparseVector:
        P = comm.size
        total = int(comm.allreduce_ints([x.nnz])[0]) if P > 1 else x.nnz
        name = choose(P, x.n, total, x.indices.dtype, x.dtype, self.theta, self.model, x.width)
        inner = algorithm_class(name)()
        if P > 1 and _preflight_may_allocate(inner, x, total):
            _preflight_agreed(comm, inner, x)
        out = inner.reduce(comm, x)
        out.info["auto_choice"] = name
        out.info["auto_nnz_total"] = total
        if P > 1 and total > 0 and out.nnz > 0:
            kbar = total / P
            self.theta = min(1.0, max(0.0, math.log(out.nnz / kbar) / math.log(P)))
        return out


def _preflight_may_allocate(algo: Algorithm, x: SparseVector, total: int) -> bool:
    """Whether the pick's preflight may allocate on some rank (decided alike on every rank).

    recursive_doubling's allocates only past its switch point, which no input passes if N doesn't.
    """
    if type(algo).preflight is Algorithm.preflight:
        return False
    if algo.name == "recursive_doubling":
        return not sparse_is_cheaper(total, x.n, index_dtype(x.n), x.dtype, x.width)
    return True


def _preflight_agreed(comm: Communicator, algo: Algorithm, x: SparseVector) -> None:
    """Run the pick's preflight, then agree on its outcome (one small allreduce).

    The choice comes after the call's own agreement: without this, memory running out on one
    rank would leave the others waiting in the exchange.
    """
    with agreement(comm):  # (an error on one rank is raised on every rank)
        algo.preflight(x)
