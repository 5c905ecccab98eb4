"""The public entry points: ``sparsecoll.allreduce`` with collective input validation, and its
nonblocking twin ``sparsecoll.iallreduce``."""

from __future__ import annotations

import contextlib
import functools
import operator
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from . import errors
from ._array import as_array, device_scope, get_array_module, identity
from ._byname import note_named_call
from ._options import canonical, effective_options
from ._progress import SparseRequest, get_timeout, ranks_text
from .algorithms.base import Algorithm
from .comm import Communicator, thread_multiple
from .errors import CollectiveInputError, CollectiveTypeError
from .registry import get_algorithm
from .sparse import (
    VALUE_DTYPES,
    SparseVector,
    as_indices,
    check_local,
    check_same_device,
    coalesce,
)

__all__ = ["allreduce", "class_name", "collective_check", "iallreduce", "watch"]

# named values behind a signature's values: ((their positions in it, {name: value}), ...)
Detail = tuple[tuple[tuple[int, ...], dict[str, Any]], ...] | None

SIGNATURE_LEN = 9  # (a GradientReducer's 4 values and an algorithm's 5)
ALGORITHM_SIGNATURE_LEN = 5
# what to do when an algorithm instance's signature (options and state) differs
STATE_REMEDY = (
    "build the instance with the same options on every rank; one used for other calls "
    "(another communicator, n or stream): call its reset(), or its GradientReducer's, on "
    "every rank first, or keep one instance per communicator"
)
# the first signature value of a progress engine's start (see start_check): no call's
# signature begins with it (n, a step count, a dtype code are >= 0)
ENGINE_START = -(2**63) + 0x5C0


def allreduce(
    comm: Any,
    values: Any,
    indices: Any,
    *,
    n: int,
    algorithm: str | Algorithm = "allgather",
    **options: Any,
) -> SparseVector:
    """Sum sparse vectors over every rank of ``comm``; every rank gets the same result.

    A collective: every rank of ``comm`` must make the same calls in the same order. A rank
    that skips one leaves the others waiting in MPI for ever, unless the watchdog is on
    (:func:`sparsecoll.set_timeout`, or ``SPARSECOLL_TIMEOUT=seconds``), which then aborts
    the job with a diagnostic from every rank.

    Args:
        comm: an mpi4py Intracomm (``MPI.COMM_WORLD``, or any sub-communicator; None:
            COMM_WORLD) or a :class:`sparsecoll.Communicator` (which also counts bytes).
        values: 1-D float16/32/64 array of this rank's nonzeros (numpy, CuPy, or anything
            numpy takes without a copy: buffer protocol, ``__array__``, DLPack).
        indices: 1-D integer array of the same length, each in ``[0, n)``; unsorted input
            and repeated indices are allowed (repeats are summed).
        n: the dense length, the same on every rank.
        algorithm: a registered name (a new instance is built with ``options`` for every
            call, so the call depends on its arguments alone) or an Algorithm instance
            (stateful algorithms keep their state in it). A stateful selecting algorithm
            (oktopk, exdyna) reuses its threshold only through an instance: build one with
            :func:`sparsecoll.get_algorithm` and pass it to every call of a stream (one per
            stream, e.g. per layer; on every rank). A repeated call by name with the same
            options and ``n`` warns once (UserWarning) with that fix.
        **options: constructor options for a named algorithm (e.g. ``k=`` for gtopk).

    Returns:
        A coalesced :class:`SparseVector`, identical on every rank, with arrays of the same
        module as ``values`` and the same value dtype.

    Raises:
        CollectiveInputError (a ValueError) or CollectiveTypeError (a TypeError) on every
        rank when any rank's input is bad or n/dtype/algorithm differ across ranks; the
        message names the offending rank. An unknown algorithm name raises
        UnknownAlgorithmError (a ValueError), an option it does not take
        CollectiveTypeError, any other local failure CollectiveRuntimeError, on every rank
        alike. All derive from :class:`sparsecoll.SparseCollError`.

    Example (one rank here; under ``mpiexec -n P`` each value is P times this)::

        >>> import numpy as np
        >>> from mpi4py import MPI
        >>> import sparsecoll
        >>> values = np.array([0.5, -1.0, 2.0], dtype=np.float32)
        >>> out = sparsecoll.allreduce(MPI.COMM_WORLD, values, [7, 3, 7], n=10)
        >>> out
        SparseVector(n=10, nnz=2, dtype=float32)
        >>> out.indices, out.values
        (array([3, 7], dtype=int32), array([-1. ,  2.5], dtype=float32))
        >>> k = 1  # a selecting algorithm keeps about k entries of the sum
        >>> sparsecoll.allreduce(MPI.COMM_WORLD, values, [7, 3, 7], n=10, algorithm="gtopk", k=k)
        SparseVector(n=10, nnz=1, dtype=float32)

    With the watchdog on (:func:`sparsecoll.set_timeout`), the communicator's progress
    engine watches the call (it still runs here), so that a hang ends in a diagnostic.
    """
    c = Communicator.wrap(comm)
    label = f"allreduce(algorithm={_name(algorithm)!r}, n={n!r})"
    # (serial: this rank's other threads wait: their calls would interleave)
    with c.serial(), watch(c, label):
        return _allreduce(c, values, indices, n, algorithm, options, label)


def reduce_checked(algo: Algorithm, comm: Communicator, x: SparseVector) -> SparseVector:
    """``algo.reduce(comm, x)``, refusing a result that is no SparseVector with a TypeError
    naming the algorithm (a user's algorithm returning None was "'NoneType' object has no
    attribute 'info'", or 'contributed' in a GradientReducer, naming neither the algorithm
    nor what it must return). Checked on this rank after the call: nothing collective
    follows it."""
    out = algo.reduce(comm, x)
    if not isinstance(out, SparseVector):
        raise TypeError(
            f"{type(algo).__qualname__}.reduce() must return a SparseVector, got "
            f"{type(out).__name__}"
        )
    return out


def _allreduce(
    c: Communicator,
    values: Any,
    indices: Any,
    n: int,
    algorithm: Any,
    options: dict[str, Any],
    label: str,
) -> SparseVector:
    algo: Any = None
    vals: Any = None
    idx: Any = None
    x: Any = None
    wrap: Any = identity
    detail: Any = None
    try:
        if isinstance(algorithm, Algorithm):
            if options:
                raise TypeError("options go to get_algorithm() when passing an instance")
            algo = algorithm
            # (an instance's options are its own: only which algorithm it is is named)
            detail = functools.partial(_options_detail, algo, None)
        elif isinstance(algorithm, str):
            algo = get_algorithm(algorithm, **options)
            note_named_call(algo, options, n)  # (warns when a stateful one repeats)
            # (a fresh instance: its signature differs across ranks by its options alone,
            # which a mismatch's message then names, with both ranks' values; made only
            # then, when it is gathered)
            detail = functools.partial(_options_detail, algo, options)
        else:
            got = type(algorithm).__name__
            if isinstance(algorithm, type):
                got = f"the class {algorithm.__name__} (pass an instance, or its name)"
            raise TypeError(f"algorithm must be a name or an Algorithm, got {got}")
        vals, wrap = as_array(values, "values")
        idx = as_indices(indices)
        check_same_device(idx, vals)
        c.check_buffer(vals, "values")  # (an NCCLCommunicator's GPU)
        # all of it on the inputs' GPU, the checks' kernels too: CuPy refuses (or, with peer
        # access, runs from the current GPU) kernels on another GPU's arrays, and the current
        # GPU is 0 in a thread that never chose one (iallreduce's progress thread)
        with device_scope(vals), np.errstate(over="ignore", invalid="ignore"):
            check_local(idx, vals, n)
            sig = _signature(algo, vals, n)
            # the local work that can fail on this rank alone (its allocations), before the
            # agreement: coalescing, and what the algorithm prepares (a dense buffer)
            x = coalesce(idx, vals, int(n))
            if not algo.exact and bool(get_array_module(vals).isnan(x.values).any()):
                # selection cannot rank NaN (given, or made by coalescing inf and -inf at one
                # index); agreeing here keeps a lone rank from raising alone
                made = not bool(get_array_module(vals).isnan(vals).any())
                raise ValueError(
                    "values contain NaN"
                    + (" once repeated indices are summed (inf + -inf)" if made else "")
                    + " (a selecting algorithm cannot rank them)"
                )
            algo.preflight(x)
        error = None
    except Exception as exc:  # (shared with every rank: none is left waiting)
        error, sig = exc, None
    collective_check(c, error, sig, ("n", "values dtype", "algorithm"), detail, call=label)
    # IEEE sums, as MPI_SUM's: inf + (-inf) is NaN and an overflow inf, without a warning
    # (device inputs: work and return on their own GPU)
    # (apart: the algorithm's messages on a duplicate of the communicator, where the
    # caller's own, pending across this call, cannot match them)
    errstate = np.errstate(over="ignore", invalid="ignore")
    with device_scope(vals), errstate, c.measure() as stats, c.apart():
        out = reduce_checked(algo, c, x)
    out.info["stats"] = stats
    c.last_stats = stats
    if wrap is not identity:
        out.indices, out.values = wrap(out.indices), wrap(out.values)
    return out


def iallreduce(
    comm: Any,
    values: Any,
    indices: Any,
    *,
    n: int,
    algorithm: str | Algorithm = "allgather",
    **options: Any,
) -> SparseRequest:
    """Start :func:`allreduce` on the communicator's progress thread; return its request.

    ``request.wait()`` returns the SparseVector (or raises what ``allreduce`` would have
    raised, on every rank alike: input errors surface there, not here). Calls on a
    communicator run one after the other in submission order, on a duplicate of it: every
    rank must start them in the same order. ``values``, ``indices`` (and an Algorithm
    instance) are borrowed: do not modify them until the request has completed. A blocking
    call on the same communicator first waits for every pending request.

    The first nonblocking call on a communicator starts its progress engine, with one
    agreement that every rank's first nonblocking call makes (as a blocking call's input
    agreement): a rank making a blocking call there instead raises, as this one does, a
    CollectiveInputError naming which rank made which call.

    Raises:
        CollectiveInputError: this is the first nonblocking call on ``comm`` here, and
            another rank makes a blocking call instead (a blocking call and a nonblocking
            one mixed across ranks), raised on every rank of the two calls.
        RuntimeError: MPI was not initialized with MPI_THREAD_MULTIPLE, or is finalized;
            the progress engine was shut down; a forked child (the engine is the parent's).
        TypeError: ``COMM_NULL`` or a freed communicator.
        NotImplementedError: an NCCLCommunicator (its calls do not run on a progress thread).
    """
    c = Communicator.wrap(comm)
    label = f"iallreduce(algorithm={_name(algorithm)!r}, n={n!r})"

    def call() -> SparseVector:
        return allreduce(c, values, indices, n=n, algorithm=algorithm, **options)

    return c.engine(label).submit(call, label, owner=c)


def _options_detail(algo: Any, options: dict[str, Any] | None) -> Detail:
    """The detail (:func:`collective_check`) of the algorithm (its name, behind the class's
    CRC) and of a named algorithm's ``options`` (None: an instance, whose options are not
    known: behind no signature value, so that none is named against another rank's)."""
    cls = type(algo)
    # (the class too: two of one name, a user's class over a built-in's, are named by it)
    named = ((2,), {"algorithm": cls.name or cls.__qualname__, "algorithm class": class_name(cls)})
    if options is None:
        return (named, ((), {}))
    where = tuple(range(3, 3 + ALGORITHM_SIGNATURE_LEN))
    return (named, (where, canonical(effective_options(cls, options))))


def _name(algorithm: Any) -> str:
    return algorithm if isinstance(algorithm, str) else type(algorithm).__name__


def watch(c: Communicator, label: str) -> contextlib.AbstractContextManager[None]:
    """Around a blocking call on ``c``: with the watchdog on, let ``c``'s progress engine
    watch it (the call still runs in the calling thread, on ``c``; an NCCLCommunicator's
    too: its engine only watches). Unwatched: a call on the progress thread itself (its
    engine watches it already), and below MPI_THREAD_MULTIPLE (the watchdog's thread calls
    MPI; warned once)."""
    if not get_timeout() or c.on_progress_thread():
        return contextlib.nullcontext()
    if not thread_multiple():
        _unwatched()
        return contextlib.nullcontext()
    return c.engine(label, blocking=True).watching(label)


_warned: list[bool] = []


def _unwatched() -> None:
    """Warn once that the watchdog is off: its threads need MPI_THREAD_MULTIPLE (blocking
    calls under SPARSECOLL_TIMEOUT raised iallreduce's RuntimeError instead)."""
    if not _warned:
        _warned.append(True)
        warnings.warn(
            "the watchdog (SPARSECOLL_TIMEOUT) needs MPI initialized with "
            "MPI_THREAD_MULTIPLE: blocking calls run unwatched",
            RuntimeWarning,
            stacklevel=4,
        )


def _signature(algo: Any, vals: Any, n: Any) -> list[int]:
    dtype_code = VALUE_DTYPES.index(vals.dtype)
    crc = zlib.crc32(class_name(type(algo)).encode())
    return [int(n), dtype_code, crc, *algorithm_signature(algo)]


@functools.cache  # (read at every call's agreement; a class's answer never changes)
def class_name(cls: type) -> str:
    """Which class an algorithm is, as every rank can tell: its module and qualified name,
    and the class of that name it is defined over, if any. (By ``__qualname__`` alone, two
    user classes named alike in two modules, or a class and a subclass of its name, were
    one algorithm to the ranks' agreement: each rank ran its own.)"""
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


def collective_check(
    comm: Communicator,
    error: BaseException | None,
    signature: list[int] | None,
    names: tuple[str, ...] = (),
    detail: Detail | Callable[[], Detail] = None,
    *,
    call: str | None = None,
) -> None:
    """Agree on input errors across ranks; raise the same error on every rank.

    ``error`` is this rank's local error (or None); ``signature`` the integers that must be
    equal on every rank (``names`` labels the first ones in messages). One small allreduce
    when all is well; on failure the offending rank's message is shared. ``detail``:
    ``((positions, values), ...)``, the named values that the signature's values at
    ``positions`` digest (options in a CRC); gathered only when the ranks' signatures
    differ, so that the message names the first value that differs there, with both ranks'
    (or a function making it then: what it costs is paid only on a mismatch).
    ``call`` names this rank's call in the message when the ranks' calls are not of one
    kind (a progress engine's start on some ranks: see :func:`start_check`).
    """
    if error is None and signature is not None:
        # (raised here alone, a bad signature would leave the other ranks waiting)
        error = _signature_error(signature, names)
    sig = [0] * SIGNATURE_LEN if signature is None or error else _ints(signature)
    sig += [0] * (SIGNATURE_LEN - len(sig))
    # one MAX-allreduce: error flag, -(first bad rank), then +/- each signature value
    vec = [1 if error else 0, -(comm.rank if error else comm.size)]
    vec += [v for s in sig for v in (s, -s)]
    # (as Python ints: the few reads below cost a numpy scalar operation each)
    agreed = comm.allreduce_ints(vec, "max").tolist()
    # (the values' max is agreed[2::2], their min -agreed[3::2]; an engine's start is first:
    # a blocking call's input error on another rank is the mismatch's, not its own)
    if -agreed[3] == ENGINE_START and (agreed[2] != ENGINE_START or agreed[4] != -agreed[5]):
        start = sig[:2] if error is None else None  # (this rank's engine start, if it is one)
        kind = (
            {0: "nonblocking", 1: "watched"}.get(start[1])
            if start and start[0] == ENGINE_START
            else None
        )
        _raise_mixed(comm, kind or "blocking", call)
    if agreed[0]:
        bad = -agreed[1]
        kind, msg = comm.bcast_object(_describe(error) if comm.rank == bad else None, bad)
        raise getattr(errors, kind)(f"{msg} on rank {bad}") from error
    if any(hi != -lo for hi, lo in zip(agreed[2::2], agreed[3::2])):
        _raise_mismatch(comm, sig, names, detail)


def start_check(comm: Communicator, call: str | None, blocking: bool) -> None:
    """Before a communicator's progress engine duplicates it (collective): one agreement of
    the shape of a blocking call's input agreement (:func:`collective_check`), marked as an
    engine's start (for a nonblocking call, or to watch a blocking one). A rank whose first
    call there is another kind (a blocking call: its agreement matches this one in MPI)
    then raises with this one, naming both calls, instead of the duplication colliding with
    the agreement's message (MPI's "Message truncated" abort)."""
    collective_check(comm, None, [ENGINE_START, int(blocking)], call=call)


def _raise_mixed(comm: Communicator, kind: str, call: str | None) -> None:
    """Raise on every rank that blocking and nonblocking calls were mixed, naming each
    rank's call (gathered: only on this failure). ``kind``: this rank's call is
    "nonblocking" (an engine's start), "watched" (a blocking call's engine start, for the
    watchdog) or "blocking" (its input agreement). Blocking calls alone, watched on some
    ranks only, are the watchdog set on some ranks only."""
    every = comm.allgather_object((kind, call))
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


def _signature_error(signature: list[int], names: tuple[str, ...]) -> Exception | None:
    """Why ``signature`` cannot be agreed (too long, not integers, outside int64), as the
    error every rank then raises; None when it can. A custom algorithm's ``signature()``
    may differ on one rank, so this is a local error like any bad input."""
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


def _ints(signature: list[int]) -> list[int]:
    """The checked signature as Python ints (a numpy bool has no negation)."""
    return [int(operator.index(s)) for s in signature]


def _describe(error: BaseException | None) -> tuple[str, str]:
    """The name of the sparsecoll error class to raise everywhere, and the message."""
    text = _message(error)
    for cls in type(error).__mro__:
        # (the nearest of sparsecoll.errors' own: a user's algorithm may raise a subclass
        # of one, which the other ranks cannot build: they raised AttributeError "module
        # 'sparsecoll.errors' has no attribute ...", the message and the rank lost)
        if getattr(errors, cls.__name__, None) is cls:
            own = cls is type(error)
            return cls.__name__, text if own else f"{type(error).__name__}: {text}"
    if isinstance(error, TypeError):
        return "CollectiveTypeError", text
    if isinstance(error, ValueError):
        return "CollectiveInputError", text
    return "CollectiveRuntimeError", f"{type(error).__name__}: {text}"


def _message(error: BaseException | None) -> str:
    """``str(error)``, or what says it could not be had: an exception whose ``__str__``
    raises (a user's class) raised here, on the offending rank alone, before it sent the
    verdict, and the other ranks waited for it for ever."""
    try:
        return str(error)
    except Exception as exc:
        return f"<its message could not be read: str() raised {type(exc).__name__}>"


def _raise_mismatch(
    comm: Communicator,
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
            # (options, or a stateful algorithm's state: one instance used for other calls;
            # reset() forgets every state value that signature() compares)
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
