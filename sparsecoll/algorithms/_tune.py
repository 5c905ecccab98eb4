"""auto's measured refinement: which of the model's close contenders runs next.

The model ranks the candidates; its errors on a given machine (local work on shared cores,
fixed costs per message) can put the fastest second or fifth. So the first calls measure
the contenders, cheapest first, and later calls run the one with the smallest measured
time: the lower median of its last :data:`KEPT` samples (:func:`low_median`). The pick's
samples keep coming, so a pick that slows down gives way, once another's time is below its
own by more than :data:`SWITCH` (a change costs a call that is no sample, so near-equal
contenders do not take turns). The contenders are ``tries`` of the predictions within
``spread`` times the cheapest: the cheapest of each family first (a candidate's family: its
name before any ``:``, as ``ring`` of ``ring:compact``), then the rest by prediction. The
model's larger errors are an algorithm's (its messages' fixed costs, its local work), not
a wire's, so one of each family is measured before a second of any.

A sample counts only when the call before it ran the same candidate: each contender runs
:data:`SAMPLES` + 1 calls in a row and its first is dropped. A first call pays for what the
candidate did not do before (loading its kernels, its buffers) and for what the one before
it left behind (a link still busy with its bytes, or idle long enough to send a burst at
full speed). Before an instance's first sample, the first contender's first two calls are
dropped (a process's first calls also pay for its start: the link's measure, kernels
loaded from their cache).

A new regime (another n, width, dtype or device, or the global nnz moving past half or
twice where it was when the samples began) starts over. Once every contender has its
samples, the contenders stand for :data:`RECHECK` calls of the regime
(:meth:`Tuner.settled`): those calls run the fastest measured without predicting, and the
next call predicts again and may bring a new contender. A contender within :data:`CLOSE`
of the fastest with fewer than :data:`KEPT` samples runs again then, for one more sample
(one such run each time the contenders stand down), so that one early sample that came out
slow does not rule it out for good. The times are the slowest rank's,
shared by the next call's agreement, so every rank keeps the same samples and makes the
same choice. Nothing here is saved in a checkpoint: times differ from run to run, and a
restored instance measures again.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence
from typing import Any

__all__ = ["CLOSE", "KEPT", "RECHECK", "SAMPLES", "SWITCH", "Tuner", "low_median"]

SAMPLES = 1  # samples of each contender before the choice
KEPT = 4  # samples kept per candidate
RECHECK = 16  # calls a settled regime's contenders stand before the next prediction
SWITCH = 1.05  # the pick gives way to a contender whose time is below its own by this
CLOSE = 1.25  # contenders within this of the fastest's time are sampled up to KEPT times


class Tuner:
    """The samples of one auto instance's regime and the picks whose times come next."""

    __slots__ = (
        "again", "anchor", "before", "contenders", "elapsed", "fixed", "key", "key_code",
        "last", "medians", "memo", "samples", "stand", "stood", "streak", "taken",
    )  # fmt: skip

    def __init__(self) -> None:
        self.key: Any = None  # (n, width, dtypes, device) of the samples
        self.key_code = 0  # a CRC of its repr (the same on every rank)
        self.anchor = 0  # the global nnz when they began
        self.samples: dict[str, tuple[float, ...]] = {}
        self.medians: dict[str, float] = {}  # each candidate's low_median
        self.last: str | None = None  # the pick whose time the next call brings
        self.before: str | None = None  # the pick of the call before that one
        self.streak = 0  # calls of ``before`` in a row, up to it
        self.contenders: list[str] = []  # the last pick's
        self.taken = 0  # samples recorded, in every regime
        self.memo: tuple = ((), {})  # the last predictions and what they were made from
        self.stand = 0  # calls the settled contenders still stand without a prediction
        self.elapsed = 0.0  # seconds of the last pick's reduce on this rank
        self.fixed: int | None = None  # its instance's constants' CRC, once computed
        self.again: tuple[str, int] | None = None  # a close contender run again, its goal
        self.stood = False  # whether the regime's contenders stood (measured, settled) yet

    def record(self, seconds: float) -> None:
        """Add the last pick's measured time (the slowest rank's): a sample if the call before
        it ran the same candidate."""
        self.streak = self.streak + 1 if self.last is not None and self.last == self.before else 1
        if self.last is not None and self.streak >= (2 if self.taken else 3) and seconds > 0:
            kept = self.samples[self.last] = (*self.samples.get(self.last, ()), seconds)[-KEPT:]
            self.medians[self.last] = low_median(kept)
            self.taken += 1
        self.before, self.last = self.last, None

    def settled(self, key: Any, nnz: int) -> str | None:
        """The contender measured fastest, while the regime is ``key``'s and ``nnz``'s and its
        settled contenders still stand; None when a prediction and :meth:`pick` must choose."""
        if self.stand <= 0 or key != self.key or not (self.anchor / 2 <= nnz <= self.anchor * 2):
            return None
        self.stand -= 1
        return self._fastest()

    def pick(self, cost: dict[str, float], order: tuple[str, ...], key: Any, nnz: int,
             tries: int, spread: float) -> str:  # fmt: skip
        """Return the candidate to run (``cost``: the model's predictions; ties and the
        contenders' order: ``order``'s)."""
        if key != self.key or not (self.anchor / 2 <= nnz <= self.anchor * 2):
            self.key, self.anchor, self.samples, self.medians = key, nnz, {}, {}
            self.key_code = zlib.crc32(repr(key).encode())
            self.again, self.stood = None, False
        ranked = sorted((c for c in order if c in cost), key=lambda c: cost[c])
        close = [c for c in ranked if cost[c] <= spread * cost[ranked[0]]]
        families = [_family(c) for c in close]
        firsts = [c for i, c in enumerate(close) if families[i] not in families[:i]]
        chosen = set((firsts + [c for c in close if c not in firsts])[: max(tries, 1)])
        contenders = [c for c in close if c in chosen]
        self.contenders, self.stand = contenders, 0
        if len(contenders) == 1:
            return contenders[0]
        pending = [c for c in contenders if len(self.samples.get(c, ())) < SAMPLES]
        if pending:  # (the run under way first)
            return self.before if self.before in pending else pending[0]
        again = self._again() if self.stood else None
        if again is not None:
            return again
        self.stand, self.stood = RECHECK - 1, True
        return self._fastest()

    def _again(self) -> str | None:
        """The close contender to run again (:data:`CLOSE`), until its run brings one more
        sample; None when there is none, or its run just ended."""
        if self.again is not None:
            name, goal = self.again
            if name in self.contenders and len(self.samples[name]) < goal:
                return name
            self.again = None
            return None
        best = min(self.contenders, key=self.medians.__getitem__)
        limit = CLOSE * self.medians[best]
        close = [
            c for c in self.contenders
            if c != best and len(self.samples[c]) < KEPT and self.medians[c] <= limit
        ]  # fmt: skip
        if not close:
            return None
        name = min(close, key=self.medians.__getitem__)
        self.again = (name, len(self.samples[name]) + 1)
        return name

    def _fastest(self) -> str:
        """The contender with the smallest time; the one that ran last while no other's is
        below its own by :data:`SWITCH` (each change costs a call that is no sample)."""
        best = min(self.contenders, key=self.medians.__getitem__)
        run = self.before
        if run in self.contenders and self.medians[run] <= self.medians[best] * SWITCH:
            return run
        return best

    def kept(self) -> dict[str, tuple[float, ...]]:
        """Each sampled candidate's kept samples (seconds, oldest first)."""
        return dict(self.samples)

    def digest(self) -> tuple[int, ...]:
        """What must be equal on every rank, as integers (the samples come from agreed
        values, so their count and the regime stand for them)."""
        name, goal = self.again or (None, 0)
        return (
            self.key_code, self.anchor, self.taken, name_code(self.last),
            name_code(self.before), self.streak, self.stand, int(self.stood), name_code(name),
            goal,
        )  # fmt: skip


def low_median(samples: Sequence[float]) -> float:
    """The lower median: of 4 samples the second smallest, so that two slow outliers
    (a link's hiccup, a rank descheduled) move it no further than the next sample."""
    return sorted(samples)[(len(samples) - 1) // 2]


@functools.cache
def name_code(name: str | None) -> int:
    """A candidate's name as an integer, the same on every rank (0 for None)."""
    return 0 if name is None else zlib.crc32(name.encode())


def _family(name: str) -> str:
    return name.partition(":")[0]
