"""The public entry points: ``sparsecoll.allreduce`` with collective input validation, and its
nonblocking twin ``sparsecoll.iallreduce``."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ._agree import (
    ALGORITHM_SIGNATURE_LEN,
    Detail,
    agreement,
    call_signature,
    class_name,
    values_shape_detail,
    watch,
)
from ._array import as_array, device_scope, get_array_module, identity
from ._byname import note_named_call
from ._options import canonical, effective_options
from ._progress import SparseRequest
from .algorithms.base import Algorithm
from .comm import Communicator
from .registry import get_algorithm
from .sparse import SparseVector, as_indices, check_local, check_same_device, coalesce

__all__ = ["allreduce", "iallreduce", "reduce_checked"]


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
            numpy takes without a copy: buffer protocol, ``__array__``, DLPack); or 2-D,
            shape ``(nnz, D)``: rows of D values, one index per row (D the same on every
            rank; exact algorithms only).
        indices: 1-D integer array of the same length, each in ``[0, n)``; unsorted input
            and repeated indices are allowed (repeats are summed, rows elementwise).
        n: the dense length (in rows, for row values), the same on every rank.
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
        kind as ``values`` (numpy, CuPy, torch, JAX), the same value dtype and row width.

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
    naming the algorithm (a user's algorithm may return anything). Checked on this rank
    after the call: nothing collective follows it."""
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
    names = ("n", "values dtype", "algorithm")
    with agreement(c, names, call=label) as agree:
        if isinstance(algorithm, Algorithm):
            if options:
                raise TypeError("options go to get_algorithm() when passing an instance")
            algo = algorithm
            # (an instance's options are its own: only which algorithm it is is named)
            named: dict[str, Any] | None = None
        elif isinstance(algorithm, str):
            algo = get_algorithm(algorithm, **options)
            note_named_call(algo, options, n)  # (warns when a stateful one repeats)
            # (a fresh instance: its signature differs across ranks by its options alone,
            # which a mismatch's message then names, with both ranks' values)
            named = options
        else:
            got = type(algorithm).__name__
            if isinstance(algorithm, type):
                got = f"the class {algorithm.__name__} (pass an instance, or its name)"
            raise TypeError(f"algorithm must be a name or an Algorithm, got {got}")
        vals, wrap = as_array(values, "values")
        idx = as_indices(indices)
        check_same_device(idx, vals)
        c.check_buffer(vals, "values")  # (an NCCLCommunicator's GPU)
        # all of it on the inputs' GPU, the checks' kernels too (a thread that never chose
        # one, such as the progress thread, is on GPU 0)
        with device_scope(vals), np.errstate(over="ignore", invalid="ignore"):
            check_local(idx, vals, n)
            if vals.ndim == 2 and not algo.takes_rows:
                name = type(algo).name or _name(algorithm)
                raise ValueError(
                    f"algorithm {name!r} takes 1-D values only, got rows (values of shape "
                    f"{tuple(vals.shape)}): reduce rows with one that takes them (allgather, "
                    f"dsa, recursive_doubling, dense, rabenseifner, auto)"
                )
            sig = call_signature(algo, vals, n)
            agree.detail = functools.partial(_options_detail, algo, named, vals)
            # the local work that can fail on this rank alone (its allocations), before the
            # agreement: coalescing, and what the algorithm prepares (a dense buffer)
            x = coalesce(idx, vals, int(n))
            if not algo.exact and bool(get_array_module(vals).isnan(x.values).any()):
                # selection cannot rank NaN (given, or made by coalescing inf and -inf)
                made = not bool(get_array_module(vals).isnan(vals).any())
                raise ValueError(
                    "values contain NaN"
                    + (" once repeated indices are summed (inf + -inf)" if made else "")
                    + " (a selecting algorithm cannot rank them)"
                )
            algo.preflight(x)
            stats = getattr(algo, "call_stats", None)  # (what auto chooses by)
            if stats is not None:
                agree.stats = stats(x, c.size)
        agree.signature = sig
    if agree.rows is not None and agree.stats is not None:
        x.info["vote_stats"] = agree.rows
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

    Returns at once, the first call on a communicator too. ``request.wait()`` returns the
    SparseVector (or raises what ``allreduce`` would have raised, on every rank alike: input
    errors surface there, not here). Calls on a communicator run one after the other in
    submission order, on a duplicate of it: every rank must start them in the same order.
    ``values``, ``indices`` (and an Algorithm instance) are borrowed: do not modify them
    until the request has completed. A blocking call on the same communicator first waits
    for every pending request.

    The first nonblocking call on a communicator starts its progress engine, which every
    rank's first nonblocking call there does: a rank making a blocking call there instead
    raises a CollectiveInputError naming which rank made which call, and so does every
    other rank's ``wait()`` of its requests on the engine.

    Raises:
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


def _options_detail(algo: Any, options: dict[str, Any] | None, vals: Any) -> Detail:
    """The detail (:class:`~._agree.Vote`) of the algorithm (its name, behind the class's
    CRC), of a named algorithm's ``options`` (None: an instance, whose options are not
    known: behind no signature value, so that none is named against another rank's) and
    of the values' shape."""
    cls = type(algo)
    # (the class too: two of one name, a user's class over a built-in's, are named by it)
    named = ((2,), {"algorithm": cls.name or cls.__qualname__, "algorithm class": class_name(cls)})
    shape = values_shape_detail(vals)
    if options is None:
        return (named, ((), {}), shape)
    where = tuple(range(3, 3 + ALGORITHM_SIGNATURE_LEN))
    return (named, (where, canonical(effective_options(cls, options))), shape)


def _name(algorithm: Any) -> str:
    return algorithm if isinstance(algorithm, str) else type(algorithm).__name__
