"""auto: pick the exact algorithm (allgather, dsa, recursive_doubling, dense, …) per call.

The loads (the nonzeros of all ranks in each of the P equal ranges of [0, n) that dsa and
ring split by; their sum is the global nnz N) and the last call's time (its slowest rank's)
ride on the call's input agreement up to P = 8 (:data:`sparsecoll._agree.STATS_MAX_P`);
otherwise, or outside :func:`sparsecoll.allreduce`, they take two small allreduces. With P, n and
the index/value sizes they feed a latency–bandwidth–compute model (:func:`predict`,
formulas in docs/guide/algorithms.md; a range split is charged its busiest range) that
ranks the candidates (:func:`choose`: the cheapest; ties go to the earlier of
``CANDIDATES``, of which hashed and ring only when registered; P = 1 always gives
allgather). The first call
assumes independent indices; each later one uses the overlap exponent θ learned from the
previous result (K(m) = k̄·m^θ). N, the loads and the result are the same on every rank, so
every rank makes the same choice; θ is part of the signature, so use one instance per
tensor on every rank.

The model only ranks: the first calls measure its closest contenders (``tries``, ``spread``;
:mod:`._tune`) and later ones run the fastest measured, predicting again only every
:data:`~._tune.RECHECK` calls once the contenders are measured (``info["auto"]["predicted"]``
is then the last prediction). A call's time is its slowest rank's seconds in the pick, as
a benchmark's; it rides on the next call's statistics, so every rank has the same.

When the pick may allocate O(n) (dense; recursive_doubling past its switch point), its
preflight runs and the ranks agree on it first: memory running out on one rank is a
CollectiveRuntimeError on every rank. Rows of D values count D values an index (``width``).
The seconds per message and per byte sent are measured on the
communicator's links at its first call (:mod:`._link`: a small and a 1 MiB exchange, once per
communicator) unless given; the other constants describe this library's local work; pass
your own (``Auto(alpha=…, beta=…)``) to fit another machine. The
choice is in ``result.info["auto_choice"]``, the statistics and predictions behind it in
``result.info["auto"]``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import struct
import time
import weakref
import zlib
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import numpy as np

from .. import _state
from .._agree import agreement
from .._array import index_dtype, to_host
from .._options import integer, read_only, real
from ..comm import Communicator
from ..registry import algorithm_class, available_algorithms, register_algorithm
from ..sparse import SparseVector
from . import _pieces
from ._link import link_constants
from ._tune import SAMPLES, Tuner
from .base import Algorithm, range_bounds, sparse_is_cheaper
from .dsa import bruck_counts

__all__ = [
    "CANDIDATES", "Auto", "CostModel", "Why", "choose", "predict", "range_loads", "union_size",
]  # fmt: skip

CANDIDATES = (
    "allgather", "dsa", "recursive_doubling", "dense", "hashed", "ring",
    "allgather:compact", "dsa:compact", "recursive_doubling:compact", "ring:compact",
    "hashed:compact",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Machine constants of the model (seconds)."""

    alpha: float = 5e-6  # per message
    beta: float = 1e-10  # per byte sent
    gamma_merge: float = 6e-9  # per pair of a linear two-run merge
    delta: float = 2e-9  # per element of a dense pass (zero, add, scan)
    gamma_wire: float = 3e-9  # per pair of a compact wire message (encode plus decode)


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


def range_loads(x: SparseVector, P: int) -> list[int]:
    """Return this rank's nonzeros in each of the P ranges of ``range_bounds(n, P)``."""
    if P <= 1:
        return [x.nnz]
    idx = x.indices  # (sorted, in [0, n))
    inner = _inner_bounds(x.n, P, idx.dtype.str)
    if isinstance(idx, np.ndarray):
        found = idx.searchsorted(inner).tolist()
    else:
        xp = x.xp
        found = to_host(xp.searchsorted(idx, xp.asarray(inner))).tolist()
    cuts = [0, *found, len(idx)]
    return [b - a for a, b in itertools.pairwise(cuts)]


@functools.lru_cache(maxsize=64)
def _inner_bounds(n: int, P: int, itype: str) -> np.ndarray:
    """The P − 1 bounds between the ranges of [0, n), in the indices' dtype where it holds
    them (int64 keys would convert a whole int32 index array first)."""
    bounds = range_bounds(n, P)[1:-1]
    fits = int(bounds.max()) <= np.iinfo(np.dtype(itype)).max
    return bounds.astype(itype) if fits else bounds


def imbalance(loads: Any, nnz_total: int) -> float:
    """Return max/mean of the loads (1.0 with no nonzeros)."""
    return float(max(loads)) * len(loads) / nnz_total if nnz_total > 0 else 1.0


def predict(
    P: int,
    n: int,
    nnz_total: int,
    itype: Any,
    vtype: Any,
    theta: float | None = None,
    model: CostModel | None = None,
    loads: Any = None,
    width: int | None = None,
) -> dict[str, float]:
    """Return the predicted seconds of each candidate (formulas: docs/guide/algorithms.md).

    ``loads``: all ranks' nonzeros in each of the P ranges of [0, n) (:func:`range_loads`
    summed); None: N/P each. ``width``: rows of that many values an index (a dense pass
    covers n·D values).
    """
    m = model or CostModel()
    d = width or 1
    isz, vsz = np.dtype(itype).itemsize, np.dtype(vtype).itemsize * d
    pair = isz + vsz
    N = float(nnz_total)
    kbar = N / P
    lg = math.ceil(math.log2(P)) if P > 1 else 0
    log2p = math.log2(P) if P > 1 else 0.0
    if loads is not None and len(loads) != P:
        raise ValueError(f"expecting {P} loads, got {len(loads)}")
    L = n / P  # a range's length
    hot = float(max(loads)) if loads is not None and N > 0 else kbar  # busiest range's load

    def sp(nnz: float, length: float) -> float:
        return min(nnz * pair, length * vsz)

    K = union_size(P, n, kbar, theta)
    K_hot = union_size(P, L, hot / P, theta)  # the busiest range's share of the result
    goes_dense = K * pair >= n * vsz
    out = {}
    out["allgather"] = (
        2 * lg * m.alpha + m.beta * (P - 1) / P * N * pair + m.gamma_merge * N * max(1.0, log2p)
    )
    # the busiest owner receives its range from P − 1 ranks, then sends it in every Bruck round
    out["dsa"] = (
        dsa_messages(P) * m.alpha
        + m.beta * (P - 1) * sp(hot / P, L)
        + m.beta * ((P - 1) / P * sp(K, n) + lg * max(0.0, sp(K_hot, L) - sp(K / P, L)))
        + m.gamma_merge * hot * max(1.0, log2p)
        + (m.delta * n * d if goes_dense else 0.0)
    )
    # the busiest rank is newrank 0: entering round i it holds the inputs of the 2^i newranks
    # below 2^i, the first P − p of which took a folded partner's too; a folded partner
    # then sends the whole sum back
    p = 1 << (P.bit_length() - 1)
    rd = (2 * (p.bit_length() - 1) + 3 * int(p != P)) * m.alpha
    rd_sparse = []  # the sums it sends as pairs (what wire="compact" encodes)
    for i in range(p.bit_length() - 1):
        u = union_size(2**i + min(2**i, P - p), n, kbar, theta)
        merged = union_size(min(2 ** (i + 1) + min(2 ** (i + 1), P - p), P), n, kbar, theta)
        rd += m.beta * sp(u, n) + m.gamma_merge * merged
        rd_sparse += [u] if u * pair < n * vsz else []
    if p != P:
        rd += m.beta * sp(K, n)
        rd_sparse += [K] if K * pair < n * vsz else []
    if goes_dense:
        rd += m.delta * n * d
    out["recursive_doubling"] = rd
    if n <= 4 * N:
        out["dense"] = 2 * lg * m.alpha + m.beta * 2 * (P - 1) / P * n * vsz + 3 * m.delta * n * d
    if P > 1 and _registered("hashed"):
        # owners by hash: balanced whatever the skew; each owner's reduced part returns as
        # COO, or as a bitmap over its n/P indices plus values, or dense, whichever is smaller
        # (linear passes: bucketing by owner, the owners' merge, placing the parts in order;
        # decoding the bitmaps reads n bits)
        part = min(K / P * pair, L / 8 + K / P * vsz, L * vsz)
        out["hashed"] = (
            (2 * (P - 1) + 3 * lg) * m.alpha
            + m.beta * (P - 1) * (sp(kbar / P, L) + part)
            + m.gamma_merge * (kbar * max(1.0, log2p) + kbar + K)
            + (m.delta * n / 8 * d if part < K / P * pair else 0.0)
        )
        if width is None and np.dtype(vtype).kind == "f":
            # every run one wire message: this rank's pushed runs and reduced run coded,
            # the runs it receives decoded
            push = kbar / P * compact_pair(kbar / P / L, isz, vsz)
            pull = K / P * compact_pair(K / P / L, isz, vsz)
            saved = (P - 1) * (sp(kbar / P, L) - push + max(0.0, part - pull))
            coding = kbar + K / P + (P - 1) * kbar / P + K
            out["hashed:compact"] = out["hashed"] - m.beta * saved + m.gamma_wire * coding
    if P > 1 and _registered("ring"):
        # lock-step neighbour steps: each step waits for the busiest range's segment, which
        # holds the union of s chunks in reduce-scatter step s and the whole range after
        steps = [union_size(s, L, hot / P, theta) for s in range(1, P)]
        out["ring"] = (
            (4 * (P - 1) + lg) * m.alpha  # (each step's size goes first)
            + m.beta * (sum(sp(u, L) for u in steps) + (P - 1) * sp(K_hot, L))
            + m.gamma_merge * (sum(steps) + (P - 1) * hot / P)
            + (m.delta * n * d if goes_dense else 0.0)
        )
        if width is None and np.dtype(vtype).kind == "f":
            # sparse blocks as wire messages: each running sum coded and decoded once, the
            # owners' reduced blocks coded once and decoded by every rank
            sent = [u for u in steps if u * pair < L * vsz]
            sent += [K_hot] * (P - 1) if K_hot * pair < L * vsz else []
            saved = sum(u * (pair - compact_pair(u / L, isz, vsz)) for u in sent)
            out["ring:compact"] = out["ring"] - m.beta * saved + m.gamma_wire * sum(sent)
    if P > 1 and width is None and np.dtype(vtype).kind == "f":
        _add_compact(out, m, P, n, N, K, hot, L, isz, vsz, pair)
        # each round encodes the sum it sends, then decodes the one it receives in pieces
        # while the later ones are on the link: the first piece's decoding shows, the rest
        # past the transfer
        rdc = rd
        for u in rd_sparse:
            wire = m.beta * u * compact_pair(u / n, isz, vsz)
            half, c = m.gamma_wire * u / 2, _pieces.count(round(u))
            rdc += wire - m.beta * u * pair + half + half / c + max(0.0, half * (c - 1) / c - wire)
        out["recursive_doubling:compact"] = rdc
    if width is not None:  # rows go only to the algorithms that take them
        out = {k: v for k, v in out.items() if algorithm_class(k).takes_rows}
    return out


def compact_pair(density: float, isz: int, vsz: int) -> float:
    """Bytes a pair costs in a compact wire message at this density (docs/reports/wire.md):
    a gap of about log2(1/d) + 2.5 bits (its fixed width and the share of wider gaps; a
    bitmap's 1/d bits when denser), and a value a tenth smaller (its exponent coded)."""
    d = min(max(density, 1e-12), 1.0)
    bits = min(math.log2(1 / d) + 2.5, 1 / d, 8 * isz)
    return bits / 8 + 0.9 * vsz


def _add_compact(out, m, P, n, N, K, hot, L, isz, vsz, pair) -> None:
    """Add ``allgather:compact`` and ``dsa:compact``: the raw predictions with the pair
    messages' bytes at their compact size, plus encoding what a rank sends first and
    decoding what it receives (``gamma_wire`` per pair for both)."""
    kbar = N / P
    if "allgather" in out:
        saved = (P - 1) / P * N * (pair - compact_pair(kbar / n, isz, vsz))
        out["allgather:compact"] = out["allgather"] - m.beta * saved + m.gamma_wire * (kbar + N) / 2
    if "dsa" in out and K * pair < n * vsz:  # (dense ranges travel raw)
        rs = (P - 1) * hot / P * (pair - compact_pair(hot / P / L, isz, vsz))
        ag = (P - 1) / P * K * (pair - compact_pair(K / n, isz, vsz))
        # each rank encodes its pairs and its owned range once, decodes what it receives
        coding = m.gamma_wire * (kbar + (K / P + K) / 2)
        out["dsa:compact"] = out["dsa"] - m.beta * (rs + ag) + coding


def _registered(name: str) -> bool:
    return name in available_algorithms()


def choose(
    P: int,
    n: int,
    nnz_total: int,
    itype: Any,
    vtype: Any,
    theta: float | None = None,
    model: CostModel | None = None,
    loads: Any = None,
    width: int | None = None,
) -> str:
    """Return the candidate with the smallest prediction (ties: earlier in ``CANDIDATES``)."""
    if P <= 1:
        return "allgather"
    return cheapest(predict(P, n, nnz_total, itype, vtype, theta, model, loads, width))


def cheapest(cost: dict[str, float]) -> str:
    """Return the candidate of ``cost`` with the smallest prediction (ties: earlier in
    ``CANDIDATES``)."""
    return min((c for c in CANDIDATES if c in cost), key=lambda c: cost[c])


class Why(Mapping):
    """``result.info["auto"]``: a call's choice and what it came from, read-only.

    Keys: "choice", "predicted" ({candidate: seconds}, the latest prediction), "nnz" (N),
    "loads", "imbalance" (H/k̄), "theta", "alpha", "beta" (as used for the call),
    "contenders" and "measured" ({candidate: (seconds, …)}, the samples taken before it).
    Its values are made when first read, so a call that nobody asks pays for none of them.
    """

    __slots__ = ("_made", "_parts")
    KEYS = (
        "choice", "predicted", "nnz", "loads", "imbalance", "theta", "alpha", "beta",
        "contenders", "measured",
    )  # fmt: skip

    def __init__(self, choice: str, cost: dict, nnz: int, loads: list, theta: Any,
                 model: CostModel, tuner: Tuner) -> None:  # fmt: skip
        # (the tuner's contenders and predictions are replaced, never changed in place; its
        # samples are, so they are copied)
        parts = (choice, cost, nnz, loads, theta, model, tuner.contenders, tuner.kept())
        self._parts: tuple | None = parts
        self._made: dict[str, Any] | None = None

    def _values(self) -> dict[str, Any]:
        if self._made is None:
            choice, cost, nnz, loads, theta, model, contenders, samples = self._parts
            self._made = {
                "choice": choice,
                "predicted": dict(cost),
                "nnz": nnz,
                "loads": loads,
                "imbalance": imbalance(loads, nnz),
                "theta": theta,
                "alpha": model.alpha,
                "beta": model.beta,
                "contenders": list(contenders),
                "measured": samples,
            }
            self._parts = None
        return self._made

    def __getitem__(self, key: str) -> Any:
        return self._values()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.KEYS)

    def __len__(self) -> int:
        return len(self.KEYS)

    def __repr__(self) -> str:
        return repr(self._values())


# what signature() digests: the learned numbers (-1 for None: they are never negative), the
# constants' CRC and the tuner's digest
_STATE = struct.Struct("<4d11q")

# each live instance's tuner by its id (its seconds in its last pick's reduce on this rank,
# its measured contenders' samples, the slowest rank's): kept apart from its attributes,
# since a checkpoint holds those and a measured time differs from run to run
_TUNERS: dict[int, Tuner] = {}


def _tuner(auto: Auto) -> Tuner:
    tuner = _TUNERS.get(id(auto))
    if tuner is None:
        tuner = _TUNERS[id(auto)] = Tuner()
        weakref.finalize(auto, _TUNERS.pop, id(auto), None)  # (gone with the instance)
    return tuner


@register_algorithm
class Auto(Algorithm):
    """Exact: picks allgather, dsa, recursive_doubling, dense (hashed, ring) per call by a model.

    Args:
        alpha: seconds per message; None (the default): measured on the communicator's
            links at the first call on it, with ``beta``'s measure.
        beta: seconds per byte sent; None (the default): measured on the communicator's
            links at the first call on it (collective, once per communicator).
        gamma_merge: seconds per pair of a linear two-run merge.
        delta: seconds per element of a dense pass (zero, add, scan).
        gamma_wire: seconds per pair of a compact wire message (encoding plus decoding).
        calibrate: learn the seconds per byte from the calls' measured times (the mean over
            ranks, shared by the next call), in place of ``beta``. For a slow network; on an
            oversubscribed node the local work it cannot tell from bytes makes it overrate
            them (default False).
        tries: how many of the predictions within ``spread`` times the cheapest the
            first calls measure (the cheapest of each algorithm first, then the rest by
            prediction), each in two calls in a row (the first is no sample), before
            later calls run the one measured fastest; 0 or 1: the model's pick alone.
        spread: how far above the cheapest prediction a contender may be (>= 1).
    """

    name = "auto"
    takes_rows = True
    state_kinds: ClassVar[dict[str, _state.Kind] | None] = {
        "theta": _state.optional(_state.number),
        "beta_fit": _state.optional(_state.number),
        "fit_bytes": _state.number,
        "fit_rest": _state.number,
    }
    fixed_options: ClassVar[tuple[str, ...]] = (
        "model", "alpha", "beta", "gamma_merge", "delta", "gamma_wire",
        "calibrate", "tries", "spread",
    )  # fmt: skip

    def __init__(
        self,
        alpha: float | None = None,
        beta: float | None = None,
        gamma_merge: float = CostModel.gamma_merge,
        delta: float = CostModel.delta,
        gamma_wire: float = CostModel.gamma_wire,
        calibrate: bool = False,
        tries: int = 5,
        spread: float = 2.5,
    ) -> None:
        # (the model's alpha, beta are then placeholders)
        self.measured_alpha, self.measured = alpha is None, beta is None
        constants = dict(
            alpha=CostModel.alpha if alpha is None else alpha,
            beta=CostModel.beta if beta is None else beta,
            gamma_merge=gamma_merge,
            delta=delta,
            gamma_wire=gamma_wire,
        )
        for k, v in constants.items():
            if not (math.isfinite(real(k, v)) and v >= 0):  # (real: TypeError for a str)
                raise ValueError(f"{k} must be a finite non-negative number, got {v!r}")
        self.model = CostModel(**{k: real(k, v) for k, v in constants.items()})
        if not isinstance(calibrate, bool):
            raise TypeError(f"calibrate must be True or False, got {calibrate!r}")
        self.calibrate = calibrate
        self.tries = integer("tries", tries, 0)
        if not (math.isfinite(real("spread", spread)) and spread >= 1):
            raise ValueError(f"spread must be a finite number >= 1, got {spread!r}")
        self.spread = float(spread)
        self.reset()

    # the constants, read from the model: fixed at construction as the model is
    alpha = property(
        lambda self: None if self.measured_alpha else self.model.alpha,
        lambda self, value: self._refuse("alpha", value),
    )
    beta = property(
        lambda self: None if self.measured else self.model.beta,
        lambda self, value: self._refuse("beta", value),
    )
    gamma_merge = read_only("model.gamma_merge", "gamma_merge")
    delta = read_only("model.delta", "delta")
    gamma_wire = read_only("model.gamma_wire", "gamma_wire")

    def reset(self) -> None:
        """Forget the learned overlap (the next call assumes independent uniform indices)."""
        self.theta: float | None = None  # learned overlap exponent, None before a first call
        self.beta_fit: float | None = None  # learned seconds per byte, None: the model's beta
        self.fit_bytes = 0.0  # calibrating: the last pick's predicted bytes term (s per beta)
        self.fit_rest = 0.0  # and the rest of its prediction (latency and compute)
        _TUNERS.pop(id(self), None)

    def call_stats(self, x: SparseVector, P: int) -> list[int]:
        """This rank's statistics, which the call's agreement carries where it can
        (:data:`sparsecoll._agree.STATS_MAX_P`): its last call's nanoseconds in the pick
        (the slowest rank's is taken) and its loads of the P ranges (summed: their sum is
        the global nnz)."""
        return [round(_tuner(self).elapsed * 1e9), *range_loads(x, P)]

    def signature(self) -> list[int]:
        # the constants and the learned state must agree, or ranks could choose differently
        tuner = _tuner(self)
        if tuner.fixed is None:  # (the constants' CRC, once: they are fixed)
            fixed = (
                self.model, self.measured_alpha, self.measured, self.calibrate, self.tries,
                self.spread,
            )  # fmt: skip
            tuner.fixed = zlib.crc32(repr(fixed).encode())
        learned = (
            -1.0 if self.theta is None else self.theta,
            -1.0 if self.beta_fit is None else self.beta_fit,
            self.fit_bytes, self.fit_rest,
        )  # fmt: skip
        return [zlib.crc32(_STATE.pack(*learned, tuner.fixed, *tuner.digest()))]

    def reduce(self, comm: Communicator, x: SparseVector) -> SparseVector:
        P = comm.size
        rows = x.info.pop("vote_stats", None)  # (every rank's, by the call's agreement)
        tuner = _tuner(self)
        args: tuple | None = None
        if P > 1:
            if rows is None:
                nanos, loads = _gather_stats(comm, self.call_stats(x, P))
            else:
                nanos = max(row[0] for row in rows)
                loads = [sum(column) for column in zip(*rows)][1:]
            total, seconds = sum(loads), nanos / 1e9
            if self.calibrate:
                self._calibrate(seconds)
            tuner.record(seconds)
            vals = x.values
            host = isinstance(vals, np.ndarray)
            key = (x.n, vals.shape[1:], x.indices.dtype, vals.dtype, host)
            # settled contenders stand without a prediction: the last one's stands too
            name = tuner.settled(key, total)
            if name is None or self.calibrate:
                args = self._args(comm, x, total, loads)
            if name is None:
                _predicted(tuner, args, host)
                name = tuner.pick(tuner.memo[1], CANDIDATES, key, total, self.tries, self.spread)
            # (the model: this call's where it was built, else the memo's, predict's args)
            cost, model = tuner.memo[1], (args or tuner.memo[0])[6]
        else:
            total, loads, name, cost, model = x.nnz, [x.nnz], "allgather", {}, self.cost_model
        inner = _instance(name)
        start = time.perf_counter()
        if P > 1 and total >= _allocating_from(name, key):
            _preflight_agreed(comm, inner, x)
        out = inner.reduce(comm, x)
        tuner.elapsed = time.perf_counter() - start
        tuner.last = name
        if args is not None and self.calibrate:  # the pick's prediction: its bytes term, the rest
            rest, unit = (
                predict(*args[:6], dataclasses.replace(args[6], beta=b), *args[7:])[name]
                for b in (0.0, 1.0)
            )
            self.fit_bytes, self.fit_rest = unit - rest, rest
        out.info["auto_choice"] = name
        out.info["auto_nnz_total"] = total
        out.info["auto"] = Why(name, cost, total, loads, self.theta, model, tuner)
        if P > 1 and total > 0 and out.nnz > 0:
            theta = _overlap(out.nnz, total, P)
            if theta != self.theta:  # (an attribute set costs a check of the fixed ones)
                self.theta = theta
        return out

    def _args(self, comm: Communicator, x: SparseVector, total: int, loads: list[int]) -> tuple:
        """What :func:`predict` takes for this call: the model with the link's measured
        constants where they are not given."""
        model = self.cost_model
        if self.measured_alpha or self.measured:
            alpha, beta = link_constants(comm)
            model = _measured_model(
                model,
                alpha if self.measured_alpha else model.alpha,
                beta if self.measured and self.beta_fit is None else model.beta,
            )
        return (comm.size, x.n, total, x.indices.dtype, x.dtype, self.theta, model, loads, x.width)

    @property
    def settle_calls(self) -> int:  # type: ignore[override]
        """The most calls its first measuring of the contenders takes."""
        return 0 if self.tries <= 1 else SAMPLES + 2 + (self.tries - 1) * (SAMPLES + 1)

    @property
    def cost_model(self) -> CostModel:
        """The constants the next call predicts with: ``model``, its beta learned if so."""
        if self.beta_fit is None:
            return self.model
        return dataclasses.replace(self.model, beta=self.beta_fit)

    def _calibrate(self, seconds: float) -> None:
        """Fold the last call's measured time (the slowest rank's) into the learned beta.

        Only a call whose bytes term is large enough to measure (100 kB) counts; the
        estimate is the geometric mean of the old one and the new, clipped to [1e-12, 1e-5].
        """
        if not self.calibrate or self.fit_bytes < 1e5 or seconds <= 0:
            return
        seen = min(max((seconds - self.fit_rest) / self.fit_bytes, 1e-12), 1e-5)
        self.beta_fit = seen if self.beta_fit is None else math.sqrt(self.beta_fit * seen)


@functools.lru_cache(maxsize=64)
def _measured_model(model: CostModel, alpha: float, beta: float) -> CostModel:
    """``model`` with the measured link constants."""
    return dataclasses.replace(model, alpha=alpha, beta=beta)


@functools.cache
def _instance(name: str) -> Algorithm:
    """An instance of the candidate ``name`` (``algorithm:wire`` with a wire): they keep no
    state between calls, so one serves every call (a registered name keeps its class)."""
    base, _, wire = name.partition(":")
    return algorithm_class(base)(**({"wire": wire} if wire else {}))


def _predicted(tuner: Tuner, args: tuple, host: bool) -> dict[str, float]:
    """:func:`predict` of ``args`` (the last call's again when they are equal); without the
    compact wire unless ``host`` (device arrays travel raw: it is host-only)."""
    key = (*args[:7], tuple(args[7]), args[8], host)
    if tuner.memo[0] != key:
        cost = predict(*args)
        if not host:
            cost = {k: v for k, v in cost.items() if not k.endswith(":compact")}
        tuner.memo = (key, cost)
    return tuner.memo[1]


@functools.lru_cache(maxsize=256)
def _allocating_from(name: str, key: tuple) -> float:
    """The global nnz from which the pick ``name``'s preflight may allocate on some rank, for
    inputs of ``key`` (n, row shape, index and value dtypes, host): inf for none, 0 for
    any. recursive_doubling's allocates only past its switch point, which no input passes if
    N doesn't."""
    if type(_instance(name)).preflight is Algorithm.preflight:
        return math.inf
    if name.partition(":")[0] != "recursive_doubling":
        return 0.0
    n, row, _, vtype, _ = key
    width = row[0] if row else None
    # the least N that sparse_is_cheaper(N, n, …) refuses
    low, high = 0, n + 1
    while low < high:
        mid = (low + high) // 2
        if sparse_is_cheaper(mid, n, index_dtype(n), np.dtype(vtype), width):
            low = mid + 1
        else:
            high = mid
    return float(low)


@functools.lru_cache(maxsize=256)
def _overlap(nnz: int, total: int, P: int) -> float:
    """θ of a result of ``nnz`` from ``total`` nonzeros over P ranks: nnz = (total/P)·P^θ."""
    return min(1.0, max(0.0, math.log(nnz / (total / P)) / math.log(P)))


def _gather_stats(comm: Communicator, stats: list[int]) -> tuple[int, list[int]]:
    """Every rank's :meth:`Auto.call_stats` combined where the agreement carried none: the
    slowest rank's nanoseconds and the loads' sums (two small allreduces, started together)."""
    slowest, first = comm.iallreduce_ints(stats[:1], "max")
    summed, rest = comm.iallreduce_ints(stats[1:], "sum")
    slowest.wait()
    summed.wait()
    return int(first[0]), rest.tolist()


def _preflight_agreed(comm: Communicator, algo: Algorithm, x: SparseVector) -> None:
    """Run the pick's preflight, then agree on its outcome (one small allreduce).

    The choice comes after the call's own agreement: without this, memory running out on one
    rank would leave the others waiting in the exchange.
    """
    with agreement(comm):  # (an error on one rank is raised on every rank)
        algo.preflight(x)
