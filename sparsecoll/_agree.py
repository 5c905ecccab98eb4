"""The agreement: every rank checks its own input, and all ranks raise the same error.

A collective call first runs its local checks, then one small MAX-allreduce (a nonblocking
one, completed at once: :class:`Vote`) of an error flag and a signature, the integers that
must be equal on every rank (n, dtype code, algorithm class CRC, options). A rank's local
error, or signatures that differ, become the same :mod:`sparsecoll.errors` exception on every
rank, naming the offending rank. :func:`agreement` wraps the local work of a call.

A progress engine's start (:func:`start_vote`) votes in the same shape, so a rank making a
blocking call where another starts an engine matches its vote, and both raise "blocking and
nonblocking calls mixed". The starters also duplicate the communicator (``MPI_Comm_idup``);
a rank that meets a start in its agreement joins that duplication, and the message about the
mix travels on the duplicate, apart from the user's traffic.

The communicator is passed in (duck-typed); this module never imports the transport.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import warnings
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from . import errors
from ._mpilib import thread_multiple
from ._progress import ranks_text
from ._timeout import get_timeout
from .errors import CollectiveInputError, CollectiveTypeError
from .sparse import VALUE_DTYPES

__all__ = [
    "ALGORITHM_SIGNATURE_LEN",
    "ENGINE_START",
    "ROW_WIDTH_AT",
    "SIGNATURE_LEN",
    "STATE_REMEDY",
    "ValuesShape",
    "Vote",
    "agreement",
    "algorithm_signature",
    "call_signature",
    "class_name",
    "collective_check",
    "share_error",
    "start_vote",
    "values_shape_detail",
    "watch",
]

# up to this many ranks, every vote carries each rank's call statistics (auto's: its last
# call's time and its nonzeros in each of the P equal ranges of [0, n), P + 1 ints) in a slot
# of its own, so that a MAX gives every rank all of them without a round of their own;
# P(P+1) ints, at most 72
STATS_MAX_P = 8
# named values behind a signature's values: ((their positions in it, {name: value}), ...)
Detail = tuple[tuple[tuple[int, ...], dict[str, Any]], ...] | None

SIGNATURE_LEN = 9  # (a GradientReducer's 4 values and an algorithm's 5)
ALGORITHM_SIGNATURE_LEN = 5
ROW_WIDTH_AT = 3 + ALGORITHM_SIGNATURE_LEN  # an allreduce's row width, after its algorithm's
# what to do when an algorithm instance's signature (options and state) differs
STATE_REMEDY = (
    "build the instance with the same options on every rank; one used for other calls "
    "(another communicator, n or stream): call its reset(), or its GradientReducer's, on "
    "every rank first, or keep one instance per communicator"
)
# the first signature value of a progress engine's start: no call's signature begins with
# it (n, a step count, a dtype code are >= 0)
ENGINE_START = -(2**63) + 0x5C0


def watch(c: Any, label: str) -> contextlib.AbstractContextManager[None]:
    """Around a blocking call on ``c``: with the watchdog on, let ``c``'s progress engine
    watch it (the call still runs in the calling thread, on ``c``). Unwatched: a call on the
    progress thread itself (its engine watches it already), and below MPI_THREAD_MULTIPLE
    (the watchdog's thread calls MPI; warned once)."""
    if not get_timeout() or c.on_progress_thread():
        return contextlib.nullcontext()
    if not thread_multiple():
        _unwatched()
        return contextlib.nullcontext()
    return c.engine(label, blocking=True).watching(label)


_warned: list[bool] = []


def _unwatched() -> None:
    """Warn once that the watchdog is off: its threads need MPI_THREAD_MULTIPLE."""
    if not _warned:
        _warned.append(True)
        warnings.warn(
            "the watchdog (SPARSECOLL_TIMEOUT) needs MPI initialized with "
            "MPI_THREAD_MULTIPLE: blocking calls run unwatched",
            RuntimeWarning,
            stacklevel=4,
        )


def call_signature(algo: Any, vals: Any, n: Any) -> list[int]:
    """The signature of an allreduce: n, the values' dtype, the algorithm and its own, and
    last (at ``ROW_WIDTH_AT``) the values' row width (0: 1-D values)."""
    dtype_code = VALUE_DTYPES.index(vals.dtype)
    crc = zlib.crc32(class_name(type(algo)).encode())
    sig = [int(n), dtype_code, crc, *algorithm_signature(algo)]
    sig += [0] * (ROW_WIDTH_AT - len(sig))
    return [*sig, int(vals.shape[1]) if vals.ndim == 2 else 0]


class ValuesShape(str):
    """The shape of a call's values, as a mismatch names it: ``(nnz,)`` or ``(nnz, D)``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


def values_shape_detail(vals: Any) -> tuple[tuple[int, ...], dict[str, Any]]:
    """The detail (:class:`Vote`) behind the row width of :func:`call_signature`."""
    shape = "(nnz,)" if vals.ndim == 1 else f"(nnz, {int(vals.shape[1])})"
    return ((ROW_WIDTH_AT,), {"values shape": ValuesShape(shape)})


@functools.cache  # (read at every call's agreement; a class's answer never changes)
def class_name(cls: type) -> str:
    """Which class an algorithm is, as every rank can tell: its module and qualified name,
    and the class of that name it is defined over, if any (two classes of one qualified
    name, or a class and a subclass of its name, are told apart)."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    for base in cls.__mro__[1:]:
        if f"{base.__module__}.{base.__qualname__}" == name:
            return f"{name} (a subclass of {class_name(base)})"
    return name


def algorithm_signature(algo: Any) -> list[Any]:
    """``algo.signature()``; more than ALGORITHM_SIGNATURE_LEN values is this rank's input
    error (agreed like any other: the caller catches it before the agreement)."""
    sig = list(algo.signature())
    if len(sig) > ALGORITHM_SIGNATURE_LEN:
        raise CollectiveInputError(
            f"an algorithm's signature() has at most {ALGORITHM_SIGNATURE_LEN} values, got "
            f"{len(sig)} from {type(algo).__name__}"
        )
    return sig


class Vote:
    """One agreement in flight: this rank's vote, its MAX-allreduce started on ``comm``.

    ``error`` is this rank's local error (or None); ``signature`` the integers that must be
    equal on every rank (``names`` labels the first ones in messages). ``detail``:
    ``((positions, values), ...)``, the named values that the signature's values at
    ``positions`` digest (options in a CRC), or a function making it; gathered only when
    the signatures differ, so the message names the first value that differs, with both
    ranks'. ``call`` names this rank's call when the ranks' calls are not of one kind.
    ``poll``: complete the vote by Test calls with sleeps (an engine's start does: it may
    wait long for late ranks); None: as ``comm`` completes its calls.
    """

    __slots__ = ("_agreed", "_req", "call", "comm", "detail", "error", "names", "rows", "sig")

    def __init__(
        self,
        comm: Any,
        error: BaseException | None,
        signature: Sequence[Any] | None,
        names: tuple[str, ...] = (),
        detail: Detail | Callable[[], Detail] = None,
        call: str | None = None,
        poll: bool | None = None,
        stats: Sequence[int] | None = None,
    ) -> None:
        if error is None and signature is not None:
            # (raised here alone, a bad signature would leave the other ranks waiting)
            error = _signature_error(signature, names)
        sig = [0] * SIGNATURE_LEN if signature is None or error else _ints(signature)
        sig += [0] * (SIGNATURE_LEN - len(sig))
        # one MAX-allreduce: error flag, -(first bad rank), then +/- each signature value
        vec = [1 if error else 0, -(comm.rank if error else comm.size)]
        vec += [v for s in sig for v in (s, -s)]
        P = comm.size
        if 1 < P <= STATS_MAX_P:  # (every vote alike: any two may meet)
            slots = [0] * (P * (P + 1))
            if stats is not None and error is None:
                slots[comm.rank * (P + 1) : (comm.rank + 1) * (P + 1)] = stats
            vec += slots
        self.rows: list[list[int]] | None = None
        self.comm, self.error, self.sig, self.names = comm, error, sig, names
        self.detail, self.call = detail, call
        self._req, self._agreed = comm.iallreduce_ints(vec, "max", poll=poll)

    def settle(self, duplicate: Any = None) -> None:
        """Complete the vote; raise the agreed error on every rank (nothing when all agree).

        ``duplicate``: the duplication that this rank's engine start began (None: not a
        start; this rank joins the starters' duplication when it meets one)."""
        self._req.wait()
        comm, error, sig = self.comm, self.error, self.sig
        # (as Python ints: the few reads below cost a numpy scalar operation each; the
        # values' max is agreed[2::2], their min -agreed[3::2])
        agreed = self._agreed.tolist()
        end = 2 + 2 * SIGNATURE_LEN
        if len(agreed) > end:
            P = comm.size
            self.rows = [agreed[end + r * (P + 1) : end + (r + 1) * (P + 1)] for r in range(P)]
            agreed = agreed[:end]
        if -agreed[3] == ENGINE_START:  # some rank starts an engine: every rank duplicated
            mine = error is None and sig[0] == ENGINE_START  # (this rank's own start)
            if duplicate is None:
                duplicate = comm.duplicate()
            if agreed[2] != ENGINE_START or agreed[4] != -agreed[5]:
                # (an engine's start is checked first: a blocking call's input error on
                # another rank is the mismatch's, not its own)
                kind = {0: "nonblocking", 1: "watched"}.get(sig[1]) if mine else None
                _raise_mixed(duplicate.get(), kind, self.call)
        if agreed[0]:
            bad = -agreed[1]
            kind, msg = comm.bcast_object(_describe(error) if comm.rank == bad else None, bad)
            raise getattr(errors, kind)(f"{msg} on rank {bad}") from error
        if any(hi != -lo for hi, lo in zip(agreed[2::2], agreed[3::2])):
            _raise_mismatch(comm, sig, self.names, self.detail)


def collective_check(
    comm: Any,
    error: BaseException | None,
    signature: Sequence[Any] | None,
    names: tuple[str, ...] = (),
    detail: Detail | Callable[[], Detail] = None,
    *,
    call: str | None = None,
    stats: Sequence[int] | None = None,
) -> list[list[int]] | None:
    """Agree on input errors across ranks; raise the same error on every rank (see
    :class:`Vote`). One small allreduce when all is well; on failure the offending rank's
    message is shared. Returns every rank's ``stats`` as the vote carried them (a row a
    rank; None where it carries none)."""
    vote = Vote(comm, error, signature, names, detail, call, stats=stats)
    vote.settle()
    return vote.rows


class agreement:
    """Around a call's local work: an Exception raised in it is this rank's input error,
    agreed on leaving (:func:`collective_check`) with ``signature`` (set inside; ignored
    after an error) and ``detail``: every rank then raises the same error, or none does.
    With ``check=False`` nothing is agreed (the caller agreed already): errors propagate.
    ``stats`` (set inside) ride on the vote; every rank's (``rows``) are set on leaving.

        with agreement(comm, ("n", "values dtype"), call=label) as agree:
            ...local checks...
            agree.signature = [n, dtype_code]
    """

    __slots__ = ("call", "check", "comm", "detail", "names", "rows", "signature", "stats")

    def __init__(
        self,
        comm: Any,
        names: tuple[str, ...] = (),
        detail: Detail | Callable[[], Detail] = None,
        *,
        call: str | None = None,
        check: bool = True,
    ) -> None:
        self.comm, self.names, self.detail, self.call = comm, names, detail, call
        self.check = check
        self.signature: Sequence[Any] | None = None
        self.stats: Sequence[int] | None = None
        self.rows: list[list[int]] | None = None

    def __enter__(self) -> agreement:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> bool:
        if not self.check or (error is not None and not isinstance(error, Exception)):
            return False
        sig = None if error is not None else self.signature
        self.rows = collective_check(
            self.comm, error, sig, self.names, self.detail, call=self.call, stats=self.stats
        )
        return True  # (reached without an error only: an agreed error raises above)


def start_vote(comm: Any, call: str | None, blocking: bool) -> Vote:
    """Start the vote of a progress engine's start on ``comm``: the shape of a blocking
    call's input agreement, marked as a start (``blocking``: to watch a blocking call), so
    that a rank whose call there is another kind matches it and both raise, naming both
    calls. Settle it with the start's duplication (:meth:`Vote.settle`)."""
    return Vote(comm, None, [ENGINE_START, int(blocking)], call=call, poll=True)


def share_error(comm: Any, counts: Sequence[int], error: BaseException | None, call: str) -> None:
    """Raise on every rank the error of the first rank whose count in ``counts`` (just
    exchanged; a rank's -1: its ``error``) is negative, named by that rank: a
    CollectiveTypeError for a TypeError, else a CollectiveInputError."""
    bad = next((r for r, c in enumerate(counts) if c < 0), None)
    if bad is None:
        return
    mine = (isinstance(error, TypeError), str(error)) if comm.rank == bad else None
    typed, msg = comm.bcast_object(mine, bad)
    kind = CollectiveTypeError if typed else CollectiveInputError
    raise kind(f"{call}: {msg} on rank {bad}") from error


def _raise_mixed(dup: Any, kind: str | None, call: str | None) -> None:
    """Raise on every rank that blocking and nonblocking calls were mixed, naming each
    rank's call (gathered on ``dup``, the start's duplicate, then freed). ``kind``: this
    rank's call is "nonblocking" (an engine's start), "watched" (a blocking call's engine
    start, for the watchdog) or None (a blocking call's input agreement). Blocking calls
    alone, watched on some ranks only, are the watchdog set on some ranks only."""
    try:
        every = dup.allgather_object((kind or "blocking", call))
    finally:
        if dup.mpi_comm is not None:  # (a TorchCommunicator's new group is torch's to end)
            dup.mpi_comm.Free()
    if all(k != "nonblocking" for k, _ in every):
        on = [r for r, (k, _) in enumerate(every) if k == "watched"]
        off = [r for r, (k, _) in enumerate(every) if k != "watched"]
        raise CollectiveInputError(
            f"the watchdog is on on {ranks_text(on)} but off on {ranks_text(off)} (in "
            f"{every[0][1] or 'a blocking call'}): set it alike on every rank "
            f"(sparsecoll.set_timeout, SPARSECOLL_TIMEOUT); a watched call starts the "
            f"communicator's progress engine, which every rank must do together"
        )
    ranks: dict[str, list[int]] = {}
    for r, (k, c) in enumerate(every):
        what = f"a {'nonblocking' if k == 'nonblocking' else 'blocking'} call"
        ranks.setdefault(what + (f" ({c})" if c else ""), []).append(r)
    listed = "; ".join(f"{ranks_text(rs)}: {what}" for what, rs in ranks.items())
    raise CollectiveInputError(
        f"blocking and nonblocking calls mixed on this communicator ({listed}): every rank "
        f"must make the same calls in the same order (the first nonblocking call on a "
        f"communicator starts its progress engine, which every rank must do together)"
    )


def _signature_error(signature: Sequence[Any], names: tuple[str, ...]) -> Exception | None:
    """Why ``signature`` cannot be agreed (too long, not integers, outside int64), as the
    error every rank then raises; None when it can."""
    if len(signature) > SIGNATURE_LEN:
        return CollectiveInputError(
            f"at most {SIGNATURE_LEN} signature values, got {len(signature)}"
        )
    for i, s in enumerate(signature):
        what = names[i] if i < len(names) else "an algorithm option"
        try:
            s = operator.index(s)  # (int() would truncate 1.5 to 1: unequal values agreed)
        except TypeError:
            kind = type(s).__name__
            return CollectiveTypeError(f"{what} must be an integer in the signature, got {kind}")
        if not -(2**63) < s < 2**63:
            return CollectiveInputError(f"{what} does not fit in int64: {s}")
    return None


def _ints(signature: Sequence[Any]) -> list[int]:
    """The checked signature as Python ints (a numpy bool has no negation)."""
    return [int(operator.index(s)) for s in signature]


def _describe(error: BaseException | None) -> tuple[str, str]:
    """The name of the sparsecoll error class to raise everywhere, and the message."""
    text = _message(error)
    for cls in type(error).__mro__:
        # the nearest of sparsecoll.errors' own: the other ranks can build only those (a
        # user's algorithm may raise a subclass of one)
        if getattr(errors, cls.__name__, None) is cls:
            own = cls is type(error)
            return cls.__name__, text if own else f"{type(error).__name__}: {text}"
    if isinstance(error, TypeError):
        return "CollectiveTypeError", text
    if isinstance(error, ValueError):
        return "CollectiveInputError", text
    return "CollectiveRuntimeError", f"{type(error).__name__}: {text}"


def _message(error: BaseException | None) -> str:
    """``str(error)``, or what says it could not be had (a user's ``__str__`` may raise:
    the offending rank must still send its verdict)."""
    try:
        return str(error)
    except Exception as exc:
        return f"<its message could not be read: str() raised {type(exc).__name__}>"


def _raise_mismatch(
    comm: Any,
    sig: list[int],
    names: tuple[str, ...],
    detail: Detail | Callable[[], Detail] = None,
) -> None:
    gathered = comm.allgather_object((sig, detail() if callable(detail) else detail))
    every = [s for s, _ in gathered]
    for r, other in enumerate(every):
        if other != every[0]:
            pos = next(
                (i for i, (a, b) in enumerate(zip(other, every[0])) if a != b),
                min(len(other), len(every[0])),
            )
            _raise_detail(pos, r, gathered[r][1], gathered[0][1])
            what = names[pos] if pos < len(names) else "algorithm options"
            a = other[pos] if pos < len(other) else None
            b = every[0][pos] if pos < len(every[0]) else None
            dtype = what.endswith(" dtype")  # "values dtype", GradientReducer's "grad dtype"
            if dtype:  # (a dtype mismatch is a TypeError, as a bad dtype is)
                a, b = VALUE_DTYPES[a], VALUE_DTYPES[b]
            if what in ("n", "step") or dtype or what.endswith("size"):
                raise (CollectiveTypeError if dtype else CollectiveInputError)(
                    f"{what} must be the same on every rank: rank {r} has {a}, rank 0 has {b}"
                )
            # options, or a stateful algorithm's state: reset() forgets every state value
            # that signature() compares
            if what == "algorithm options":
                raise CollectiveInputError(
                    f"{what} (and the state of earlier calls) must be the same on every rank: "
                    f"rank {r} differs from rank 0 ({STATE_REMEDY})"
                )
            raise CollectiveInputError(
                f"{what} must be the same on every rank: rank {r} differs from rank 0"
            )
    raise AssertionError("signature mismatch not found")  # pragma: no cover


def _raise_detail(pos: int, r: int, mine: Detail, first: Detail) -> None:
    """Name the first value that differs between rank ``r``'s ``detail`` and rank 0's among
    those behind the signature's value at ``pos`` (the first that differs); else nothing
    (the values are alike: another state; or a call of another kind on some rank)."""
    if mine is None or first is None or len(mine) != len(first):
        return
    for (where, values), (where0, values0) in zip(mine, first):
        if pos not in where or where != where0:
            continue
        for key, value in values.items():
            other = values0.get(key)
            if repr(other) != repr(value):  # (as a CRC of their repr tells them apart)
                raise CollectiveInputError(
                    f"{key} must be the same on every rank: rank {r} has {value!r}, rank 0 "
                    f"has {other!r}"
                )
