"""The collectives for traced JAX code: calls into the library, run in program order.

A collective acts on other ranks, so it must run once per call and in program order on every
rank. ``pure_callback`` promises neither (XLA may drop, duplicate or move it). On the CPU
these functions bind an XLA FFI call (:mod:`._ffi`) that hands the library the program's own
buffers (the operands read and the results written in place) and keeps the calls in program
order: chained by data in a jitted function's body, by JAX's ordered effect in loops,
branches and inner functions. Elsewhere (a GPU), or where that could not be set up
(``SPARSECOLL_JAX_FFI=0`` turns it off), the call is ``io_callback(ordered=True)``, which
copies operands to the host and results back. Called outside a trace, the functions run at
once.

Errors: the library's agreement makes every rank raise the same error in the call (a wrong
dtype, sizes differing across ranks), so no rank is left waiting. JAX raises it as a
``JaxRuntimeError`` whose message holds the library's; called outside ``jit`` these functions
raise the library's own error, and :func:`original_errors` does so around a jitted call.
JAX dispatches asynchronously: a collective call made outside ``jit`` first waits for the
jitted programs dispatched before it (:func:`_after_programs`), so every rank makes the
programs' calls first.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..._array import INT32_LIMIT
from ..._routing import before_calls
from ...api import allreduce as _allreduce
from ...comm import Communicator
from . import _ffi

__all__ = ["allreduce", "allreduce_dense", "original_errors", "step"]

_lock = threading.Lock()
_raised: list[BaseException] = []  # the last error a callback raised (guarded by _lock)
_program = threading.local()  # .running: this thread runs a call of a jitted program


def step(reducer: Any, grad: Any) -> Any:
    """Return ``reducer.step(grad)`` (a :class:`sparsecoll.GradientReducer`), traceable.

    ``grad`` is a JAX array of ``reducer.n`` elements; the update has its shape and dtype and
    is the same on every rank. The reducer keeps its residual (error feedback) on the host.
    Raises the reducer's errors on every rank (see :func:`original_errors`).
    """
    import jax
    import jax.numpy as jnp

    grad = jnp.asarray(grad)

    def run(ins: Sequence[np.ndarray], outs: Sequence[np.ndarray]) -> None:
        reducer.step(ins[0], out=outs[0])

    (update,) = _call(run, [jax.ShapeDtypeStruct(grad.shape, grad.dtype)], grad)
    return update


def allreduce(
    values: Any,
    indices: Any,
    *,
    n: int,
    capacity: int,
    count: Any = None,
    comm: Any = None,
    algorithm: Any = "allgather",
    **options: Any,
) -> tuple[Any, Any, Any]:
    """Sum sparse vectors over every rank (:func:`sparsecoll.allreduce`), traceable.

    Args:
        values, indices: this rank's entries (1-D JAX arrays of one length m).
        n: the dense length, the same on every rank.
        capacity: the length of the result's arrays (static), at least the sum's nonzeros.
        count: how many leading entries of ``values``/``indices`` are this rank's (an int
            or a traced scalar; clipped to ``[0, m]``, as JAX clips slice bounds); None: m.
        comm, algorithm, options: as :func:`sparsecoll.allreduce`'s.

    Returns:
        ``(indices, values, count)``, the same on every rank: the sum's first ``count``
        entries in ascending index order, then index ``n`` and value 0 up to ``capacity``
        (``x.at[indices].add(values, mode="drop")`` ignores them). Indices are int32.

    Raises:
        ValueError on every rank when the sum has more than ``capacity`` nonzeros; the
        library's errors on every rank (see :func:`original_errors`).
    """
    import jax
    import jax.numpy as jnp

    values, indices = jnp.asarray(values), jnp.asarray(indices)
    capacity, n = operator.index(capacity), operator.index(n)
    if capacity < 0:
        raise ValueError(f"capacity must be non-negative, got {capacity}")
    if n > INT32_LIMIT:
        raise ValueError(f"n must be at most {INT32_LIMIT} (int32 indices), got {n}")
    m = int(values.shape[0]) if values.ndim else 0
    count = jnp.asarray(m if count is None else count, jnp.int32)
    c = Communicator.wrap(comm)

    def run(ins: Sequence[np.ndarray], outs: Sequence[np.ndarray]) -> None:
        (v, i, k), (idx, val, total) = ins, outs
        k = min(max(int(k), 0), m)
        out = _allreduce(c, v[:k], i[:k], n=n, algorithm=algorithm, **options)
        nnz = out.nnz
        if nnz > capacity:  # (the sum is the same on every rank: each raises here)
            raise ValueError(f"the sum has {nnz} nonzeros, over capacity={capacity}")
        idx[:nnz], idx[nnz:] = out.indices, n
        val[:nnz], val[nnz:] = out.values, 0
        total[...] = nnz

    shapes = [
        jax.ShapeDtypeStruct((capacity,), jnp.int32),
        jax.ShapeDtypeStruct((capacity,), values.dtype),
        jax.ShapeDtypeStruct((), jnp.int32),
    ]
    return tuple(_call(run, shapes, values, indices, count))


def allreduce_dense(x: Any, *, comm: Any = None, algorithm: Any = "allgather", **options: Any):
    """Return the sum over every rank of the dense JAX array ``x`` (its nonzeros reduced by
    :func:`sparsecoll.allreduce`), of ``x``'s shape and dtype, the same on every rank.

    A selecting ``algorithm`` (e.g. ``"gtopk", k=``) keeps about ``k`` entries of the sum;
    without error feedback: for training use :func:`step`.
    """
    import jax
    import jax.numpy as jnp

    x = jnp.asarray(x)
    c = Communicator.wrap(comm)

    def run(ins: Sequence[np.ndarray], outs: Sequence[np.ndarray]) -> None:
        flat, dense = ins[0].reshape(-1), outs[0].reshape(-1)
        idx = np.flatnonzero(flat)  # (a wrong dtype is refused by every rank's allreduce)
        out = _allreduce(c, flat[idx], idx, n=flat.size, algorithm=algorithm, **options)
        dense[...] = 0
        dense[out.indices] = out.values

    (total,) = _call(run, [jax.ShapeDtypeStruct(x.shape, x.dtype)], x)
    return total


@contextlib.contextmanager
def original_errors() -> Iterator[None]:
    """Raise the library's error in place of the ``JaxRuntimeError`` that carries it.

    Around a jitted call that reduces with these functions (``with original_errors():
    params = train_step(params, batch)``): a CollectiveInputError raised in a callback then
    reaches the caller as itself, chained to JAX's error.
    """
    import jax

    with _lock:
        _raised.clear()
    try:
        yield
    except jax.errors.JaxRuntimeError as exc:
        with _lock:
            found = _raised.pop() if _raised else None
        if found is None or str(found) not in str(exc):
            raise
        raise found from exc


def _call(run: _ffi.Run, shapes: Sequence[Any], *args: Any) -> list[Any]:
    """The results of ``run(inputs, outputs)``, which fills ``outputs`` (of ``shapes``): an
    ordered call inside a trace, at once outside one (raising ``run``'s error as itself)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback

    if not any(isinstance(a, jax.core.Tracer) for a in args):
        outs = [np.empty(s.shape, s.dtype) for s in shapes]
        run([np.asarray(a) for a in args], outs)
        return [jnp.asarray(o) for o in outs]

    if _after_programs not in before_calls:
        before_calls.append(_after_programs)

    def recorded(ins: Sequence[np.ndarray], outs: Sequence[np.ndarray]) -> None:
        _program.running = True
        try:
            run(ins, outs)
        except BaseException as exc:
            with _lock:
                _raised[:] = [exc]
            raise
        finally:
            _program.running = False

    if jax.default_backend() == "cpu" and _ffi.available():
        return _ffi.call(recorded, shapes, *args)

    held: list[np.ndarray] = []  # this traced call's results, reused: XLA copies them out

    def callback(*arrays: Any) -> tuple[np.ndarray, ...]:
        # (JAX hands the callback host jax.Arrays: their numpy views, without a copy)
        if not held:
            held[:] = [np.empty(s.shape, s.dtype) for s in shapes]
        recorded([np.asarray(a) for a in arrays], held)
        return tuple(held)

    return list(io_callback(callback, tuple(shapes), *args, ordered=True))


def _after_programs(comm: Any) -> None:
    """Before a call on ``comm`` made outside a jitted program: wait for the programs
    dispatched before it, whose calls come first on every rank."""
    del comm
    if getattr(_program, "running", False):
        return
    import jax

    jax.effects_barrier()  # (the io_callback path's programs, on any device)
    if _ffi.available():
        _ffi.fence()
