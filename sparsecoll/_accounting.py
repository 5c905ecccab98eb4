"""Byte and message accounting of a Communicator: :class:`CommStats` and the counting rules.

Payload, per rank (metadata such as counts and validation codes is kept apart in the
``meta_*`` fields): point-to-point calls and ``alltoallv`` count the bytes actually sent and
received (self excluded); ``allgatherv`` what a bandwidth-optimal (ring) allgather moves per
rank: every other rank's part received and as much sent, ``ceil(log2 P)`` messages;
``allreduce`` what a bandwidth-optimal (Rabenseifner/ring) allreduce moves per rank:
``2 (P-1)/P`` of the buffer sent and received, ``2 ceil(log2 P)`` messages. Staging copies
of device buffers are not communication.

Traffic goes to the running totals (``stats``) and to the calling thread's open
``measure()`` scopes; a request's, to the scopes open in the thread that submitted it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["Accounting", "CommStats"]


@dataclasses.dataclass
class CommStats:
    """Cumulative counters; subtract two snapshots to get the cost of what ran between."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    messages_sent: int = 0
    messages_recv: int = 0
    meta_bytes_sent: int = 0
    meta_messages_sent: int = 0

    def copy(self) -> CommStats:
        return dataclasses.replace(self)

    def __sub__(self, other: CommStats) -> CommStats:
        return CommStats(
            *(getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self))
        )

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(CommStats))


class _Scope:
    """One open :meth:`Communicator.measure` scope: what it has counted so far."""

    __slots__ = ("open", "stats")

    def __init__(self) -> None:
        self.stats = CommStats()
        self.open = True


class Accounting:
    """The counting half of a Communicator (which sets ``stats``, ``_last``, ``_scopes``,
    ``_stats_lock``, ``rank`` and ``size``)."""

    stats: CommStats
    rank: int
    size: int
    _last: threading.local
    _scopes: threading.local
    _stats_lock: Any

    @property
    def last_stats(self) -> CommStats:
        """What the calling thread's last :func:`sparsecoll.allreduce` on this Communicator
        moved (its ``info["stats"]``; empty before its first). Per thread, as
        :meth:`measure` scopes are: not another thread's call, nor a request completed on
        the progress thread (the request's result has its own ``info["stats"]``)."""
        last = getattr(self._last, "stats", None)
        if last is None:
            last = self._last.stats = CommStats()
        return last

    @last_stats.setter
    def last_stats(self, stats: CommStats) -> None:
        self._last.stats = stats

    def reset_stats(self) -> None:
        with self._stats_lock:
            self.stats = CommStats()

    def _count(self, **fields: int) -> None:
        """Count traffic that the calling thread's call moved: in the running totals and in
        the thread's open :meth:`measure` scopes on this Communicator."""
        self._add(fields.items(), self._open_scopes())

    def _add_stats(self, delta: CommStats, scopes: Sequence[_Scope] = ()) -> None:
        """Add ``delta`` to the running totals, and to those of ``scopes`` still open (a
        request's: the scopes of the thread that submitted it, open then; the progress
        thread adds its traffic when it completes)."""
        self._add([(name, getattr(delta, name)) for name in _STATS_FIELDS], scopes)

    def _add(self, items: Any, scopes: Sequence[_Scope]) -> None:
        with self._stats_lock:
            for into in (self.stats, *(s.stats for s in scopes if s.open)):
                for name, value in items:
                    setattr(into, name, getattr(into, name) + value)

    def _open_scopes(self) -> list[_Scope]:
        """The calling thread's open :meth:`measure` scopes on this Communicator."""
        scopes = getattr(self._scopes, "open", None)
        if scopes is None:
            scopes = self._scopes.open = []
        return scopes

    @contextlib.contextmanager
    def _measure(self) -> Iterator[CommStats]:
        scope = _Scope()
        scopes = self._open_scopes()
        scopes.append(scope)
        try:
            yield scope.stats
        finally:
            with self._stats_lock:  # (a request completing now adds to it or not at all)
                scope.open = False
            scopes.remove(scope)

    def _log2(self) -> int:
        return math.ceil(math.log2(self.size)) if self.size > 1 else 0

    @staticmethod
    def _nbytes(buf: Any) -> int:
        return int(buf.nbytes)

    def _count_send(self, buf: Any, dest: int) -> None:
        if dest != self.rank:
            self._count(bytes_sent=self._nbytes(buf), messages_sent=1)

    def _count_recv(self, buf: Any, source: int) -> None:
        if source != self.rank:
            self._count(bytes_recv=self._nbytes(buf), messages_recv=1)

    def _count_allgatherv(self, others: int) -> None:
        log2 = self._log2()
        self._count(bytes_sent=others, bytes_recv=others, messages_sent=log2, messages_recv=log2)

    def _count_alltoallv(self, sb: list[int], rb: list[int]) -> None:
        me = self.rank
        self._count(
            bytes_sent=sum(sb) - sb[me],
            bytes_recv=sum(rb) - rb[me],
            messages_sent=sum(1 for j, c in enumerate(sb) if c and j != me),
            messages_recv=sum(1 for j, c in enumerate(rb) if c and j != me),
        )

    def _count_allreduce(self, nbytes: int) -> None:
        moved = 2 * (self.size - 1) * nbytes // self.size
        rounds = 2 * self._log2()
        self._count(bytes_sent=moved, bytes_recv=moved, messages_sent=rounds, messages_recv=rounds)

    def _meta(self, nbytes: int, messages: int) -> None:
        if self.size > 1:
            self._count(meta_bytes_sent=nbytes, meta_messages_sent=messages)
