"""auto's measured refinement: which of the model's close contenders runs next.

The model ranks the candidates; its errors on a given machine (local work on shared cores,
fixed costs per message) can put the fastest second or third. So the first calls try the
contenders (the cheapest ``tries`` predictions within ``spread`` times the cheapest), each
:data:`SAMPLES` times in turn, and later calls run the one with the smallest measured time
(the least of its last :data:`KEPT` samples: interference only slows a call down). Its
samples keep coming, so a pick that slows down gives way. A new regime (another n, width,
dtype or device, or the global nnz moving past half or twice where it was when the samples
began) starts over.

The times are every rank's mean, shared by the next call's agreement, so every rank keeps
the same samples and makes the same choice. Nothing here is saved in a checkpoint: times
differ from run to run, and a restored instance measures again.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KEPT", "SAMPLES", "Tuner"]

SAMPLES = 2  # samples of each contender before the choice (the first may be a cold start)
KEPT = 4  # samples kept per candidate


class Tuner:
    """The samples of one auto instance's regime and the pick whose time comes next."""

    __slots__ = ("anchor", "contenders", "key", "last", "memo", "samples", "taken")

    def __init__(self) -> None:
        self.key: Any = None  # (n, width, dtypes, device) of the samples
        self.anchor = 0  # the global nnz when they began
        self.samples: dict[str, list[float]] = {}
        self.last: str | None = None  # the pick whose time the next call brings
        self.contenders: list[str] = []  # the last pick's
        self.taken = 0  # samples recorded, in every regime
        self.memo: tuple = ((), {})  # the last predictions and what they were made from

    def record(self, seconds: float) -> None:
        """Add the last pick's measured time (every rank's mean)."""
        if self.last is not None and seconds > 0:
            kept = self.samples.setdefault(self.last, [])
            kept.append(seconds)
            del kept[:-KEPT]
            self.taken += 1
        self.last = None

    def pick(self, cost: dict[str, float], order: tuple[str, ...], key: Any, nnz: int,
             tries: int, spread: float) -> str:  # fmt: skip
        """Return the candidate to run (``cost``: the model's predictions; ties and the
        contenders' order: ``order``'s)."""
        if key != self.key or not (self.anchor / 2 <= nnz <= self.anchor * 2):
            self.key, self.anchor, self.samples = key, nnz, {}
        ranked = sorted((c for c in order if c in cost), key=lambda c: cost[c])
        best = cost[ranked[0]]
        contenders = [c for c in ranked[: max(tries, 1)] if cost[c] <= spread * best]
        self.contenders = contenders
        counts = [len(self.samples.get(c, ())) for c in contenders]
        if min(counts) < SAMPLES:  # (in turn: the fewest samples, then the cheaper)
            return contenders[counts.index(min(counts))]
        return min(contenders, key=lambda c: min(self.samples[c]))

    def estimates(self) -> dict[str, float]:
        """Each sampled candidate's measured seconds (the least kept sample)."""
        return {c: min(s) for c, s in self.samples.items() if s}

    def kept(self) -> dict[str, list[float]]:
        """Each sampled candidate's kept samples (seconds, oldest first)."""
        return {c: list(s) for c, s in self.samples.items()}

    def digest(self) -> tuple:
        """What must be equal on every rank (the samples come from agreed values, so their
        count and the regime stand for them)."""
        return (self.key, self.anchor, self.taken, self.last)
