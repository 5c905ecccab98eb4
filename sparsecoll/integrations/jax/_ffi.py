"""Calls into Python from a jitted CPU program: XLA FFI calls that hand the library the
program's buffers in place, without the copies an ``io_callback`` makes, run in program order.

The handler is a ``ctypes`` function pointer registered as a typed XLA FFI target
(``xla/ffi/api/c_api.h``, API 0.x), so no compiled extension is needed. Each traced call
binds a primitive with an ``op`` key into :data:`_ops`; XLA calls the handler with the
operands' and results' buffers, and the handler runs ``_ops[op](inputs, outputs)`` on numpy
views of them. An exception becomes an XLA FFI error whose message is the exception's
(``JaxRuntimeError`` at the caller).

Order. A collective must run once per call and in the same order on every rank:
- Calls bound in the body of a jitted function (the outermost trace) form a chain: each call
  takes the previous one's extra int32 result as an operand, so XLA runs them in the order
  the program makes them, one at a time. Such a call carries no JAX effect, so the program
  keeps JAX's fast C++ dispatch.
- A call bound in a nested trace (a loop or branch body, an inner ``jit``), and every later
  call of the same outermost trace, carries JAX's ordered I/O effect instead: its lowering
  threads the same token as ``io_callback(ordered=True)``. It also takes the chain's last
  value, so it runs after the chained calls before it.
- Programs run in the order they were dispatched (XLA's CPU client runs a device's
  programs one after another).
A chained call is lowered only into the program's own body; lowered elsewhere (its function
traced alone first, then called from another jitted function) it raises while compiling,
the same on every rank.

This builds on JAX internals (traces, the effect, the lowering context's tokens).
:func:`available` says whether it could be set up; the callers fall back to ``io_callback``
where it could not, or where the program does not run on the CPU.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

TARGET = "sparsecoll_python_cpu"

Run = Callable[[Sequence[np.ndarray], Sequence[np.ndarray]], None]
_ops: dict[int, Run] = {}  # op key -> what a call runs (kept: a compiled program may rerun it)
_keys = itertools.count(1)
_setup_lock = threading.Lock()
_state: dict[str, Any] = {}  # the primitives once set up ("chained", "ordered"), or "error"
# outermost trace -> [the chain's last value, whether its later calls are ordered]
_chains: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


class _Base(ctypes.Structure):
    pass


_Base._fields_ = [
    ("struct_size", ctypes.c_size_t),
    ("type", ctypes.c_int),
    ("next", ctypes.POINTER(_Base)),
]


class _Version(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("major", ctypes.c_int),
        ("minor", ctypes.c_int),
    ]


class _Metadata(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("api_version", _Version),
        ("traits", ctypes.c_uint32),
        ("state_type_id", ctypes.c_int64),
    ]


class _MetadataExtension(ctypes.Structure):
    _fields_ = [("base", _Base), ("metadata", ctypes.POINTER(_Metadata))]


class _Buffer(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("dtype", ctypes.c_int),
        ("data", ctypes.c_void_p),
        ("rank", ctypes.c_int64),
        ("dims", ctypes.POINTER(ctypes.c_int64)),
    ]


class _List(ctypes.Structure):  # XLA_FFI_Args and XLA_FFI_Rets share this layout
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("size", ctypes.c_int64),
        ("types", ctypes.POINTER(ctypes.c_int)),
        ("items", ctypes.POINTER(ctypes.c_void_p)),
    ]


class _ByteSpan(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _Scalar(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int), ("value", ctypes.c_void_p)]


class _Attrs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("size", ctypes.c_int64),
        ("types", ctypes.POINTER(ctypes.c_int)),
        ("names", ctypes.POINTER(ctypes.POINTER(_ByteSpan))),
        ("attrs", ctypes.POINTER(ctypes.c_void_p)),
    ]


class _CallFrame(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.POINTER(_Base)),
        ("api", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
        ("stage", ctypes.c_int),
        ("args", _List),
        ("rets", _List),
        ("attrs", _Attrs),
        ("future", ctypes.c_void_p),
    ]


class _ErrorCreateArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("message", ctypes.c_char_p),
        ("errc", ctypes.c_int),
    ]


class _ApiHead(ctypes.Structure):  # the leading fields of XLA_FFI_Api
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("api_version", _Version),
        ("internal_api", ctypes.c_void_p),
        ("error_create", ctypes.c_void_p),
    ]


_ErrorCreate = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_ErrorCreateArgs))
_Handler = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_CallFrame))

_METADATA, _EXECUTE, _TOKEN, _ERRC_UNKNOWN = 1, 3, 17, 2
_API_MAJOR, _API_MINOR = 0, 1  # the oldest 0.x this handler's structures match

_DTYPES = {
    1: np.bool_, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.uint8,
    7: np.uint16, 8: np.uint32, 9: np.uint64, 10: np.float16, 11: np.float32,
    12: np.float64, 15: np.complex64, 18: np.complex128,
}  # fmt: skip


class _View:
    """A buffer's numpy view, without a copy (numpy's array interface)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, buf: _Buffer) -> None:
        dtype = np.dtype(_dtype(buf.dtype))
        shape = tuple(buf.dims[i] for i in range(buf.rank))
        self.__array_interface__ = {
            "data": (buf.data or 0, False),
            "shape": shape,
            "typestr": dtype.str,
            "version": 3,
        }


def _dtype(code: int) -> Any:
    if code == 16:  # bfloat16, from the package JAX itself uses
        import ml_dtypes

        return ml_dtypes.bfloat16
    try:
        return _DTYPES[code]
    except KeyError:
        raise TypeError(f"XLA FFI data type {code} is not supported") from None


def _arrays(lst: _List) -> list[np.ndarray]:
    out = []
    for i in range(lst.size):
        buf = ctypes.cast(lst.items[i], ctypes.POINTER(_Buffer)).contents
        if buf.dtype == _TOKEN:
            continue
        if buf.data is None:  # (an empty array may have no storage)
            shape = tuple(buf.dims[j] for j in range(buf.rank))
            out.append(np.empty(shape, _dtype(buf.dtype)))
        else:
            out.append(np.asarray(_View(buf)))
    return out


def _op_key(attrs: _Attrs) -> int:
    for i in range(attrs.size):
        name = attrs.names[i].contents
        if ctypes.string_at(name.ptr, name.len) == b"op":
            scalar = ctypes.cast(attrs.attrs[i], ctypes.POINTER(_Scalar)).contents
            return ctypes.cast(scalar.value, ctypes.POINTER(ctypes.c_int64)).contents.value
    raise KeyError("the call has no 'op' attribute")


def _error(frame: _CallFrame, exc: BaseException) -> int:
    head = ctypes.cast(frame.api, ctypes.POINTER(_ApiHead)).contents
    message = f"{type(exc).__name__}: {exc}".encode(errors="replace")
    args = _ErrorCreateArgs(ctypes.sizeof(_ErrorCreateArgs), None, message, _ERRC_UNKNOWN)
    return _ErrorCreate(head.error_create)(ctypes.byref(args))


def _handle(frame_ptr: Any) -> int | None:
    frame = frame_ptr.contents
    ext = frame.extension_start
    if ext and ext.contents.type == _METADATA:  # the registry asks which API this speaks
        meta = ctypes.cast(ext, ctypes.POINTER(_MetadataExtension)).contents.metadata.contents
        meta.api_version.major, meta.api_version.minor = _API_MAJOR, _API_MINOR
        meta.traits = 0
        return None
    if frame.stage != _EXECUTE:
        return None
    try:
        _ops[_op_key(frame.attrs)](_arrays(frame.args), _arrays(frame.rets))
    except BaseException as exc:  # (reaches the caller as XLA's error, with this message)
        return _error(frame, exc)
    return None


_handler = _Handler(_handle)  # (kept alive with the module: XLA holds its address)


def available() -> bool:
    """Whether the FFI path is set up (once per process); SPARSECOLL_JAX_FFI=0 turns it off."""
    if os.environ.get("SPARSECOLL_JAX_FFI", "1") == "0":
        return False
    with _setup_lock:
        if "chained" not in _state and "error" not in _state:
            try:
                _state.update(_setup())
            except Exception as exc:  # (a JAX without these internals: io_callback instead)
                _state["error"] = exc
        return "chained" in _state


def call(run: Run, shapes: Sequence[Any], *args: Any) -> list[Any]:
    """Bind one FFI call, in program order: ``run(inputs, outputs)`` fills ``outputs`` (numpy
    views of XLA's result buffers, of ``shapes``) from ``inputs``; returns the results."""
    import jax
    import jax.numpy as jnp
    from jax._src import core
    from jax._src.interpreters.partial_eval import DynamicJaxprTrace

    trace = core.trace_ctx.trace
    outer, nested = trace, not isinstance(trace, DynamicJaxprTrace)
    while not isinstance(getattr(outer, "parent_trace", None), (core.EvalTrace, type(None))):
        outer, nested = outer.parent_trace, True
    chain = _chains.setdefault(outer, [None, False])
    last, ordered = chain
    chain[1] = ordered = ordered or nested

    def chained(ins: Sequence[np.ndarray], outs: Sequence[np.ndarray]) -> None:
        outs[-1][...] = 0
        run(ins[:-1], outs[:-1])

    key = next(_keys)
    _ops[key] = chained
    link = jnp.zeros((), jnp.int32) if last is None else last
    shapes = (*shapes, jax.ShapeDtypeStruct((), jnp.int32))
    prim = _state["ordered" if ordered else "chained"]
    *results, link = prim.bind(*args, link, op=key, shapes=shapes)
    if not nested:
        chain[0] = link
    return results


def fence() -> None:
    """Wait for the programs dispatched to the CPU before (XLA runs them in order)."""
    import jax
    import jax.numpy as jnp

    if "fence" not in _state:
        _state["fence"] = jax.jit(lambda x: x + 1), jnp.zeros((), jnp.int32)
    program, operand = _state["fence"]
    program(operand).block_until_ready()


def _in_program_body() -> bool:
    """Whether lowering is in the module's entry function, outside any region of it."""
    from jax._src.lib.mlir import ir

    op = ir.InsertionPoint.current.block.owner.operation
    return op.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main"


def _setup() -> dict[str, Any]:
    import dataclasses

    import jax
    from jax._src import core
    from jax._src.callback import _OrderedIOEffect
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    capsule = jax.ffi.pycapsule(ctypes.cast(_handler, ctypes.c_void_p))
    jax.ffi.register_ffi_target(TARGET, capsule, platform="cpu")
    rule = jax.ffi.ffi_lowering(TARGET, has_side_effect=True)

    def avals(shapes: tuple) -> list[Any]:
        return [core.ShapedArray(s.shape, s.dtype) for s in shapes]

    def chained_lowering(ctx: Any, *args: Any, op: int, shapes: tuple) -> Any:
        del shapes
        if not _in_program_body():
            raise ValueError(
                "a sparsecoll call traced in the body of one jitted function is compiled "
                "inside another function or a loop, where the order of its calls is not "
                "kept; trace the outer function first, or call jax.clear_caches() before "
                "tracing it"
            )
        return rule(ctx, *args, op=np.int64(op))

    def ordered_lowering(ctx: Any, *args: Any, op: int, shapes: tuple) -> Any:
        del shapes
        token = ctx.tokens_in.get(_OrderedIOEffect)
        with_token = dataclasses.replace(
            ctx,
            avals_in=[core.abstract_token, *ctx.avals_in],
            avals_out=[core.abstract_token, *ctx.avals_out],
        )
        token, *results = rule(with_token, token, *args, op=np.int64(op))
        ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({_OrderedIOEffect: token})))
        return results

    chained = Primitive("sparsecoll_ffi_call")
    chained.multiple_results = True
    chained.def_abstract_eval(lambda *avs, op, shapes: avals(shapes))
    mlir.register_lowering(chained, chained_lowering, platform="cpu", cacheable=False)

    ordered = Primitive("sparsecoll_ffi_call_ordered")
    ordered.multiple_results = True
    ordered.def_effectful_abstract_eval(
        lambda *avs, op, shapes: (avals(shapes), {_OrderedIOEffect})
    )
    mlir.register_lowering(ordered, ordered_lowering, platform="cpu", cacheable=False)
    return {"chained": chained, "ordered": ordered}
