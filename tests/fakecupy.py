"""A numpy-backed stand-in for CuPy, strict about host/device mixing, for machines with no GPU.

It lets CI run sparsecoll's device code paths (dispatch on the array module, host staging,
CUDA-aware hand-off, selection logic) without a GPU. Like CuPy, its arrays refuse implicit
conversion to numpy (``np.asarray(x)`` raises TypeError), refuse numpy operands in
arithmetic, indexing and assignment, return 0-d arrays from reductions, and copy only
through ``asarray`` (host to device) and ``get``/``set``. Custom kernels cannot run here:
``ElementwiseKernel`` looks the kernel's name up in ``KERNELS``, numpy re-statements of
sparsecoll's few CUDA kernels. So this checks the Python around the kernels, never the CUDA
source itself: that needs a real GPU (tests/test_gpu.py, tests/mpi/test_gpu.py).

Install with :func:`installed` (a context manager that puts it in ``sys.modules['cupy']``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

__all__ = ["KERNELS", "installed", "module", "nccl", "ndarray"]


def _refuse(what: Any) -> TypeError:
    return TypeError(f"Unsupported type {type(what)}")


def _unwrap(obj: Any) -> Any:
    """Turn fake arrays into numpy ones; refuse numpy arrays (host data) anywhere inside."""
    if isinstance(obj, ndarray):
        return obj._a
    if isinstance(obj, np.ndarray):
        raise _refuse(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unwrap(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _unwrap(v) for k, v in obj.items()}
    return obj


def _wrap(obj: Any, dev: int | None = None) -> Any:
    """Fake arrays for numpy results: new arrays land on the current device (as CuPy
    allocates there), views given ``dev`` stay on their base's device."""
    if isinstance(obj, np.ndarray):
        return ndarray(obj, dev)
    if isinstance(obj, np.generic):  # CuPy reductions give 0-d arrays, not scalars
        return ndarray(np.asarray(obj), dev)
    if isinstance(obj, tuple):
        return tuple(_wrap(o, dev) for o in obj)
    if isinstance(obj, list):
        return [_wrap(o, dev) for o in obj]
    return obj


# CuPy compiles every kernel with -ftz=true (cupy/cuda/compiler.py), so its own ufuncs read
# float32 subnormals as zeros of their sign where the instruction has an .ftz form: abs,
# comparisons (so the nonzero tests too: count_nonzero, flatnonzero, a cast to bool),
# min/max and the widening to float64 (PTX abs.ftz.f32, setp.ge.ftz.f32, min.ftz.f32,
# cvt.ftz.f64.f32). The fake does the same there, so that code comparing magnitudes with
# CuPy's operators fails here as on a GPU. (Its float32 sums and products flush too,
# add.rn.ftz.f32: not modelled, as the library's dense sums on the device are allowed to:
# docs/guide/gpu.md.)
_FTZ_UFUNCS = {
    np.absolute, np.fabs, np.maximum, np.minimum, np.fmax, np.fmin, np.greater,
    np.greater_equal, np.less, np.less_equal, np.equal, np.not_equal,
}  # fmt: skip
_FTZ_FUNCTIONS = {"abs", "maximum", "minimum", "max", "min", "count_nonzero", "flatnonzero"}
_FTZ_COMPARE = {"__lt__", "__le__", "__eq__", "__ne__", "__gt__", "__ge__"}


def _ftz(a: Any) -> Any:
    """``a`` with its float32 subnormals flushed to zeros of their sign (numpy arrays and
    scalars; anything else as it is)."""
    if isinstance(a, (np.ndarray, np.generic)) and a.dtype == np.float32:
        sub = (a != 0) & (np.abs(a) < np.finfo(np.float32).tiny)
        if np.any(sub):
            out = np.where(sub, np.copysign(np.float32(0), a), a).astype(np.float32)
            return out if isinstance(a, np.ndarray) else out[()]
    return a


def _ftz_all(objs: Any) -> Any:
    return type(objs)(_ftz(o) for o in objs)


def _widens(kwargs: dict) -> bool:
    """Whether a ufunc call computes in float64 (float32 inputs are widened first)."""
    dt = kwargs.get("dtype")
    return dt is not None and np.dtype(dt) == np.float64


def _on_current_device(*objs: Any) -> None:
    """Refuse fake arrays that live on another device than the thread's current one, as
    CuPy's kernels do (``_check_peer_access`` in cupy/_core/_kernel.pyx: a ValueError
    without peer access between the GPUs; with it, a PerformanceWarning and the kernel
    reads the other GPU's memory from the current one, its outputs allocated there)."""
    _Stream.launched += 1  # (every caller is a kernel or a copy on the stream)
    cur = _Device.current()
    for obj in objs:
        if isinstance(obj, ndarray):
            if obj._dev != cur:
                raise ValueError(
                    f"The device where the array resides ({obj._dev}) is different from the "
                    f"current device ({cur}). Peer access is unavailable between these devices."
                )
        elif isinstance(obj, (list, tuple)):
            _on_current_device(*obj)
        elif isinstance(obj, dict):
            _on_current_device(*obj.values())


class _Flags:
    def __init__(self, a: np.ndarray) -> None:
        self.c_contiguous = bool(a.flags.c_contiguous)
        self.f_contiguous = bool(a.flags.f_contiguous)
        self.owndata = bool(a.flags.owndata)


class _Device:
    """A fake GPU. The current device is per host thread, as in CUDA: a new thread (e.g.
    a progress thread) starts on device 0 whatever its creator had selected."""

    id = 0
    count = 2  # fake GPUs per process: enough to catch work on the wrong one
    shared = False  # True: every process reports the same GPU (as ranks sharing one GPU)
    _local = threading.local()

    def __init__(self, device: int | None = None) -> None:
        self.id = _Device.current() if device is None else int(device)
        if not 0 <= self.id < _Device.count:
            raise RuntimeError(f"cudaErrorInvalidDevice: invalid device ordinal {self.id}")
        self._prev: list[int] = []

    @staticmethod
    def current() -> int:
        return getattr(_Device._local, "id", 0)

    @property
    def pci_bus_id(self) -> str:
        return "0000:00:00.0" if _Device.shared else f"fake:{os.getpid()}:{self.id}"

    def use(self) -> None:
        _Device._local.id = self.id

    def __enter__(self) -> _Device:
        self._prev.append(_Device.current())
        self.use()
        return self

    def __exit__(self, *exc: Any) -> None:
        _Device._local.id = self._prev.pop()

    def synchronize(self) -> None:
        _Stream.waited()


class _Stream:
    """CuPy's stream, as far as the tests look: how often it was synchronized, and
    whether work was queued since (``pending``). Every kernel or copy the fake runs counts
    as queued; a synchronize, and a copy to the host (``get``, ``int()``, ...: blocking),
    waits for all of it."""

    ptr = 0
    syncs = 0  # how often any stream was synchronized (tests look at it)
    launched = 0  # kernels and copies queued so far
    synced = 0  # ``launched`` at the last wait

    def synchronize(self) -> None:
        _Stream.syncs += 1
        _Stream.waited()

    @staticmethod
    def waited() -> None:
        _Stream.synced = _Stream.launched

    @staticmethod
    def pending() -> bool:
        """Whether a kernel or copy was queued after the last wait for the stream (as
        torch reading memory the fake wrote would race with it on a GPU)."""
        return _Stream.launched > _Stream.synced


class _Pointer:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class ndarray:
    """A device array: a numpy array that only the fake module may touch."""

    __slots__ = ("_a", "_dev")
    __array_priority__ = 100

    def __init__(self, a: np.ndarray, dev: int | None = None) -> None:
        if not isinstance(a, np.ndarray):
            raise TypeError(f"expecting a numpy array, got {type(a)}")
        self._a = a
        self._dev = _Device.current() if dev is None else dev

    # -- interop ----------------------------------------------------------------------
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        a = self._a
        return {
            "shape": a.shape,
            "typestr": a.dtype.str,
            "data": (int(a.__array_interface__["data"][0]), not a.flags.writeable),
            "strides": None if a.flags.c_contiguous else a.strides,
            "version": 3,
            "stream": None,
        }

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. "
            "Please use `.get()` to construct a NumPy array explicitly."
        )

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        try:
            args = _unwrap(inputs)
            kw = _unwrap(kwargs)
        except TypeError:
            return NotImplemented
        _on_current_device(inputs, kwargs)
        if ufunc in _FTZ_UFUNCS or _widens(kw):
            args = _ftz_all(args)
        return _wrap(getattr(ufunc, method)(*args, **kw))

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if not all(issubclass(t, ndarray) for t in types):
            return NotImplemented
        return getattr(module, func.__name__)(*args, **kwargs)

    def get(self, stream: Any = None, order: str = "C", out: Any = None, blocking: bool = True):
        if blocking:
            _Stream.waited()  # (a blocking copy waits for the work queued before it)
        if out is None:
            return np.array(self._a, order=order, copy=True)
        if not isinstance(out, np.ndarray):
            raise TypeError("out must be a numpy array")
        if out.shape != self._a.shape or out.dtype != self._a.dtype:
            raise ValueError("shape or dtype mismatch")
        np.copyto(out, self._a)
        return out

    def set(self, arr: Any, stream: Any = None) -> None:
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"Only numpy.ndarray can be set to cupy.ndarray, got {type(arr)}")
        if arr.shape != self._a.shape or arr.dtype != self._a.dtype:
            raise ValueError("shape or dtype mismatch")
        if not self._a.flags.c_contiguous:
            raise RuntimeError("set() needs a contiguous array")
        np.copyto(self._a, arr)

    def tolist(self) -> Any:
        _Stream.waited()
        return self._a.tolist()

    def item(self) -> Any:
        _Stream.waited()
        return self._a.item()

    # -- attributes ---------------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: _Flags(self._a))
    T = property(lambda self: ndarray(self._a.T, self._dev))
    device = property(lambda self: _Device(self._dev))
    data = property(lambda self: _Pointer(int(self._a.__array_interface__["data"][0])))

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self) -> Iterator[Any]:
        return (_wrap(v, self._dev) for v in self._a)

    def __repr__(self) -> str:
        return f"fakecupy.{self._a!r}"

    def __bool__(self) -> bool:
        _Stream.waited()
        return bool(self._a)

    def __int__(self) -> int:
        _Stream.waited()
        return int(self._a)

    def __float__(self) -> float:
        _Stream.waited()
        return float(self._a)

    # no __index__: cupy.ndarray has none (a 0-d device array is no slice bound, range()
    # argument or list index; int() it, a visible sync)

    # -- indexing -----------------------------------------------------------------------
    def __getitem__(self, key: Any) -> Any:
        k = _unwrap(key)
        if _is_basic_index(k):  # a view: no kernel, it stays on its device
            return _wrap(self._a[k], self._dev)
        _on_current_device(self, key)
        return _wrap(self._a[k])

    def __setitem__(self, key: Any, value: Any) -> None:
        _on_current_device(self, key, value)
        self._a[_unwrap(key)] = _unwrap(value)

    # -- methods ------------------------------------------------------------------------
    def astype(self, dtype: Any, copy: bool = True, **kw: Any) -> ndarray:
        if not copy and np.dtype(dtype) == self._a.dtype:
            return self
        _on_current_device(self)
        a = _ftz(self._a) if np.dtype(dtype) in (np.float64, np.bool_) else self._a
        return ndarray(a.astype(dtype, copy=copy, **kw))

    def view(self, dtype: Any = None) -> ndarray:
        return ndarray(self._a.view(dtype), self._dev)

    def reshape(self, *shape: Any, **kw: Any) -> ndarray:
        out = self._a.reshape(*shape, **kw)
        if not np.shares_memory(out, self._a):  # a copy: a kernel
            _on_current_device(self)
            return ndarray(out)
        return ndarray(out, self._dev)

    def argsort(self, axis: int = -1, kind: Any = None) -> ndarray:
        if kind not in (None, "stable"):
            raise ValueError("kind can only be None or 'stable'")
        _on_current_device(self)
        return ndarray(np.argsort(self._a, axis=axis, kind="stable"))

    def sort(self, axis: int = -1, kind: Any = None) -> None:
        if kind not in (None, "stable"):
            raise ValueError("kind can only be None or 'stable'")
        _on_current_device(self)
        self._a.sort(axis=axis, kind="stable")

    def __getattr__(self, name: str) -> Any:
        # the remaining ndarray methods (copy, reshape, sum, min, cumsum, ...), strict
        if name.startswith("__"):
            raise AttributeError(name)
        attr = getattr(self._a, name)
        if not callable(attr):
            raise AttributeError(name)

        if name in ("min", "max", "nonzero", "all", "any") and self._a.dtype == np.float32:
            attr = getattr(_ftz(self._a), name)

        def method(*args: Any, **kwargs: Any) -> Any:
            _on_current_device(self, args, kwargs)
            return _wrap(attr(*_unwrap(args), **_unwrap(kwargs)))

        return method


def _is_basic_index(key: Any) -> bool:
    """Whether ``key`` (unwrapped) only slices: ints, slices, Ellipsis, None."""
    keys = key if isinstance(key, tuple) else (key,)
    return all(k is None or k is Ellipsis or isinstance(k, (slice, int, np.integer)) for k in keys)


def _binary(name: str) -> Any:
    def op(self: ndarray, other: Any) -> Any:
        if isinstance(other, (np.ndarray, list, tuple)):
            raise _refuse(other)
        _on_current_device(self, other)
        a, b = self._a, _unwrap(other)
        if name in _FTZ_COMPARE:
            a, b = _ftz(a), _ftz(b)
        res = getattr(a, name)(b)
        if res is NotImplemented:
            return NotImplemented
        return self if name.startswith("__i") else _wrap(res)

    op.__name__ = name
    return op


_OPS = "add sub mul truediv floordiv mod pow and or xor lshift rshift lt le eq ne gt ge"
for _name in _OPS.split(" "):
    for _dunder in (f"__{_name}__", f"__r{_name}__", f"__i{_name}__"):
        if hasattr(np.ndarray, _dunder):
            setattr(ndarray, _dunder, _binary(_dunder))


def _unary(name: str) -> Any:
    def op(self: ndarray) -> Any:
        _on_current_device(self)
        return _wrap(getattr(_ftz(self._a) if name == "__abs__" else self._a, name)())

    op.__name__ = name
    return op


for _name in ("neg", "pos", "abs", "invert"):
    setattr(ndarray, f"__{_name}__", _unary(f"__{_name}__"))


# -- kernels ------------------------------------------------------------------------------
def _segment_sum(v: np.ndarray, h: np.ndarray, e: np.ndarray, out: np.ndarray) -> None:
    for i in range(h.shape[0]):
        acc = v[int(h[i])]
        for j in range(int(h[i]) + 1, int(e[i])):
            acc = v.dtype.type(acc + v[j])
        out[i] = acc


def _segment_sum_rows(v: np.ndarray, h: np.ndarray, e: np.ndarray, d: int, out: np.ndarray) -> None:
    # v: C-contiguous rows of width d; h and e: (segments, 1), broadcast over the columns
    rows = v.reshape(-1, int(d))
    for i in range(h.shape[0]):
        acc = rows[int(h[i, 0])].copy()
        for j in range(int(h[i, 0]) + 1, int(e[i, 0])):
            acc = (acc + rows[j]).astype(v.dtype)
        out[i] = acc


def _accumulate(*args: Any) -> None:
    # the arguments of _cupy_kernels.accumulate_kernel: g, [r], [u, m], cut, acc, [uo], sel, bad
    layouts = {5: (False, False), 6: (True, False), 8: (False, True), 9: (True, True)}
    has_r, has_u = layouts[len(args)]
    it = iter(args)
    g = next(it)
    r = next(it) if has_r else None
    u, m = (next(it), next(it)) if has_u else (None, None)
    cut = next(it)
    acc = next(it)
    uo = next(it) if has_u else None
    sel, bad = next(it), next(it)
    v = g.copy()
    if has_u:
        v = (u * g.dtype.type(m)).astype(g.dtype) + g
        uo[...] = v
    if has_r:
        v = v + r
    acc[...] = v
    sel[...] = np.abs(v) >= cut
    bad[0] += np.count_nonzero(~np.isfinite(v))


def _widen(x: np.ndarray, s: Any, c: Any, d: np.ndarray) -> None:
    d[...] = x.astype(np.float64) * s + -c


KERNELS = {
    "sparsecoll_accumulate": _accumulate,
    "sparsecoll_segment_sum": _segment_sum,
    "sparsecoll_segment_sum_rows": _segment_sum_rows,
    "sparsecoll_widen": _widen,
}


class ElementwiseKernel:
    """Runs the numpy re-statement registered under the kernel's name."""

    def __init__(
        self, in_params: str, out_params: str, operation: str, name: str = "kernel", **kwargs: Any
    ) -> None:
        if name not in KERNELS:
            raise NotImplementedError(f"fakecupy has no re-statement of kernel {name!r}")
        self.name = name
        self.n_in = len([p for p in in_params.split(",") if p.strip()])
        self.n_out = len([p for p in out_params.split(",") if p.strip()])

    def __call__(self, *args: Any, size: int | None = None) -> Any:
        if len(args) != self.n_in + self.n_out:
            raise TypeError(f"{self.name} takes {self.n_in + self.n_out} arguments (outputs given)")
        arrays = [a for a in args if isinstance(a, ndarray)]
        if not arrays:
            raise TypeError("a kernel needs at least one array argument")
        _on_current_device(args)
        KERNELS[self.name](*_unwrap(list(args)))
        return args[-1] if self.n_out == 1 else args[self.n_in :]


# -- RawModule: numpy re-statements of sparsecoll's selection kernels (select/_cupy.py) ---------
def _pick(key: np.ndarray, hi: Any, icut: Any) -> np.ndarray:
    i = np.arange(key.shape[0])
    return (key > hi) | ((key == hi) & (i <= int(icut)))


def _tiles(hit: np.ndarray, counts: np.ndarray) -> None:
    from sparsecoll.select._cupy_kernels import TILE as _TILE

    padded = np.zeros(counts.shape[0] * _TILE, dtype=np.uint32)
    padded[: hit.shape[0]] = hit
    counts[...] = padded.reshape(-1, _TILE).sum(axis=1)


def _check_ends(ends: np.ndarray, counts: np.ndarray, hits: int) -> None:
    if not np.array_equal(ends, np.cumsum(counts, dtype=np.uint64)) or int(ends[-1]) != hits:
        raise AssertionError("fakecupy: a write pass got counts that do not match its input")


def _sc_hist(bits, n, absmask, infkey, pmask, prefix, shift, hist) -> None:
    from sparsecoll.select._cupy_kernels import BINS as _BINS

    key = bits[: int(n)] & absmask
    hist[_BINS] += np.count_nonzero(key > infkey)
    key = key[(key & pmask) == prefix]
    np.add.at(
        hist, ((key >> bits.dtype.type(shift)) & bits.dtype.type(_BINS - 1)).astype(np.intp), 1
    )


def _sc_gather(bits, n, absmask, pmask, prefix, ckey, cidx, count) -> None:
    key = bits[: int(n)] & absmask
    idx = np.flatnonzero((key & pmask) == prefix)[::-1]  # (any order: the GPU's is not fixed)
    ckey[: idx.shape[0]] = key[idx]
    cidx[: idx.shape[0]] = idx
    count[0] += idx.shape[0]


def _sc_count(bits, n, absmask, infkey, cut, counts, flag) -> None:
    key = bits[: int(n)] & absmask
    _tiles(_pick(key, cut[0], cut[1]), counts)
    if np.any(key > infkey):
        flag[0] = 1


def _sc_write(bits, n, absmask, cut, ends, counts, oidx, oval) -> None:
    idx = np.flatnonzero(_pick(bits[: int(n)] & absmask, cut[0], cut[1]))
    _check_ends(ends, counts, idx.shape[0])
    oidx[...] = idx
    oval[...] = bits[idx]


def _sc_gather_packed(bits, n, absmask, pmask, prefix, cand, ncand, counts) -> None:
    key = bits[: int(n)] & absmask
    p = key & pmask
    _tiles(p > prefix, counts)
    idx = np.flatnonzero(p == prefix)[::-1]  # (any order)
    inverted = (absmask & ~key[idx]).astype(np.uint64)
    cand[: idx.shape[0]] = (inverted << np.uint64(32)) | idx.astype(np.uint64)
    ncand[0] += idx.shape[0]


def _sc_take_packed(sorted_, take, absmask, counts, cut) -> None:
    from sparsecoll.select._cupy_kernels import TILE as _TILE

    kept = sorted_[: int(take)]
    np.add.at(counts, (kept & np.uint64(0xFFFFFFFF)) // np.uint64(_TILE), 1)
    last = int(kept[-1])
    cut[0] = int(absmask) & ~(last >> 32)
    cut[1] = last & 0xFFFFFFFF


def _sc_mask_count(mask, n, counts) -> None:
    _tiles(mask[: int(n)] != 0, counts)


def _sc_mask_write(mask, n, ends, counts, oidx) -> None:
    idx = np.flatnonzero(mask[: int(n)])
    _check_ends(ends, counts, idx.shape[0])
    oidx[...] = idx


RAW_KERNELS = {
    "sc_hist": _sc_hist,
    "sc_gather": _sc_gather,
    "sc_count": _sc_count,
    "sc_write": _sc_write,
    "sc_gather_packed": _sc_gather_packed,
    "sc_take_packed": _sc_take_packed,
    "sc_mask_count": _sc_mask_count,
    "sc_mask_write": _sc_mask_write,
}


class RawModule:
    """``cupy.RawModule``: ``get_function(name)`` runs the numpy re-statement registered
    under ``name`` in ``RAW_KERNELS`` (the CUDA source is compiled only on a real GPU)."""

    def __init__(self, code: str = "", options: tuple = (), **kwargs: Any) -> None:
        if not isinstance(code, str) or not code:
            raise TypeError("RawModule needs its CUDA source")
        self.code = code

    def get_function(self, name: str) -> Any:
        if name not in RAW_KERNELS or f" {name}(" not in self.code:
            raise NotImplementedError(f"fakecupy has no re-statement of raw kernel {name!r}")

        def launch(grid: tuple, block: tuple, args: tuple, **kwargs: Any) -> None:
            if not (
                isinstance(grid, tuple) and isinstance(block, tuple) and isinstance(args, tuple)
            ):
                raise TypeError("a raw kernel takes (grid, block, args) tuples")
            if any(isinstance(a, (int, float)) and not isinstance(a, np.generic) for a in args):
                raise TypeError(f"{name}: pass scalars as numpy scalars of the C type")
            _on_current_device(args)
            RAW_KERNELS[name](*_unwrap(list(args)))

        return launch


# -- NCCL, emulated with MPI on the fake device memory (which is host memory) -------------------
class _FakeNccl(types.ModuleType):
    """``cupy.cuda.nccl`` for fake arrays: the same calls, carried out by MPI on the raw
    pointers, so the pointer arithmetic, counts and grouping of NCCLCommunicator run in CI.
    Group semantics: calls between groupStart/groupEnd run at groupEnd (point-to-point as
    nonblocking MPI, broadcasts in call order)."""

    NCCL_UINT8, NCCL_INT32, NCCL_INT64, NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64 = 1, 2, 4, 6, 7, 8
    NCCL_SUM = 0
    available = True
    _DTYPES: ClassVar[dict[int, Any]] = {
        1: np.uint8,
        2: np.int32,
        4: np.int64,
        6: np.float16,
        7: np.float32,
        8: np.float64,
    }

    def __init__(self) -> None:
        super().__init__("cupy.cuda.nccl")
        self._group: list[Any] | None = None
        self.calls: list[str] = []  # names of the calls made (tests look at them)
        fake = self

        class NcclCommunicator:
            def __init__(self, ndev: int, uid: tuple, rank: int) -> None:
                from mpi4py import MPI

                if len(uid) != 128:
                    raise ValueError("bad unique id")
                self.mpi = MPI.COMM_WORLD.Dup()
                if self.mpi.Get_size() != ndev or self.mpi.Get_rank() != rank:
                    raise RuntimeError("fake NCCL needs the ranks of COMM_WORLD")

            def destroy(self) -> None:
                if self.mpi is not None:
                    self.mpi.Free()
                    self.mpi = None

            def allReduce(self, sptr, rptr, count, dtype, op, stream):
                from mpi4py import MPI

                fake.calls.append("allReduce")
                recv = fake._arr(rptr, count, dtype)
                # NCCL sums in place when both pointers are the same; MPI needs IN_PLACE
                send = MPI.IN_PLACE if sptr == rptr else fake._arr(sptr, count, dtype)
                self.mpi.Allreduce(send, recv, MPI.SUM)

            def broadcast(self, sptr, rptr, count, dtype, root, stream):
                fake._op(self, "broadcast", sptr, rptr, count, dtype, root)

            def send(self, ptr, count, dtype, peer, stream):
                fake._op(self, "send", ptr, count, dtype, peer)

            def recv(self, ptr, count, dtype, peer, stream):
                fake._op(self, "recv", ptr, count, dtype, peer)

        self.NcclCommunicator = NcclCommunicator

    @staticmethod
    def _arr(ptr: int, count: int, dtype: int) -> np.ndarray:
        t = np.dtype(_FakeNccl._DTYPES[dtype])
        raw = (ctypes.c_uint8 * (count * t.itemsize)).from_address(ptr)
        return np.frombuffer(raw, dtype=t, count=count)

    def get_unique_id(self) -> tuple:
        return tuple(range(128))

    def groupStart(self) -> None:
        if self._group is not None:
            raise RuntimeError("nested groups are not emulated")
        self._group = []

    def groupEnd(self) -> None:
        ops, self._group = self._group, None
        if ops is None:
            raise RuntimeError("groupEnd without groupStart")
        self._run(ops)

    def _op(self, comm: Any, kind: str, *args: Any) -> None:
        self.calls.append(kind)
        if self._group is None:
            self._run([(comm, kind, *args)])
        else:
            self._group.append((comm, kind, *args))

    def _run(self, ops: list[Any]) -> None:
        from mpi4py import MPI

        reqs = []
        for comm, kind, *a in ops:
            if kind == "send":
                reqs.append(comm.mpi.Isend(self._arr(a[0], a[1], a[2]), a[3], 77))
            elif kind == "recv":
                reqs.append(comm.mpi.Irecv(self._arr(a[0], a[1], a[2]), a[3], 77))
        MPI.Request.Waitall(reqs)
        for comm, kind, *a in ops:
            if kind == "broadcast":
                sptr, rptr, count, dtype, root = a
                buf = self._arr(rptr, count, dtype)
                if comm.mpi.Get_rank() == root and sptr != rptr:
                    buf[...] = self._arr(sptr, count, dtype)
                comm.mpi.Bcast(buf, root)


nccl = _FakeNccl()


# -- the module -----------------------------------------------------------------------------
# The numpy functions the fake passes on, each with the keywords CuPy 14's function of that
# name takes (tests/test_gpu.py::test_fake_is_no_more_permissive_than_cupy checks this list
# against an installed CuPy): a function CuPy lacks, or a keyword it does not take, fails
# on the fake as it would on a GPU. Add to it only after checking CuPy.
_UFUNC_KW = ("out", "casting", "dtype")
FUNCTIONS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("empty", "ones", "zeros"), ("dtype", "order")),
    **dict.fromkeys(("empty_like", "zeros_like"), ("dtype", "order", "subok", "shape")),
    **dict.fromkeys(
        ("abs", "add", "isfinite", "isnan", "maximum", "minimum", "multiply", "subtract"),
        _UFUNC_KW,
    ),
    **dict.fromkeys(("all", "any", "max", "min"), ("axis", "out", "keepdims")),
    **dict.fromkeys(("argsort", "sort"), ("axis", "kind")),
    **dict.fromkeys(("packbits", "unpackbits"), ("axis", "bitorder")),
    "arange": ("dtype",),
    "bincount": ("weights", "minlength"),
    "concatenate": ("axis", "out", "dtype", "casting"),
    "copyto": ("casting", "where"),
    "count_nonzero": ("axis",),
    "cumsum": ("axis", "dtype", "out"),
    "dot": ("out",),
    "flatnonzero": (),
    "linspace": ("num", "endpoint", "retstep", "dtype", "axis"),
    "may_share_memory": ("max_work",),
    "partition": ("axis",),
    "searchsorted": ("side", "sorter"),
    "where": (),
}


def _function(name: str, fn: Any) -> Any:
    allowed = FUNCTIONS[name]

    def f(*args: Any, **kwargs: Any) -> Any:
        extra = sorted(set(kwargs) - set(allowed))
        if extra:
            raise TypeError(f"cupy.{name}() takes no keyword {extra[0]!r} (fakecupy.FUNCTIONS)")
        if name in ("argsort", "sort"):
            if kwargs.get("kind") not in (None, "stable"):
                raise ValueError("kind can only be None or 'stable'")
            kwargs["kind"] = "stable"
        if not name.endswith("_like"):  # (empty_like & co. only allocate: no kernel)
            _on_current_device(args, kwargs)
        args, kwargs = _unwrap(args), _unwrap(kwargs)
        if name in _FTZ_FUNCTIONS or _widens(kwargs):
            args = _ftz_all(args)
        return _wrap(fn(*args, **kwargs))

    f.__name__ = name
    return f


def _asarray(a: Any, dtype: Any = None, order: Any = None) -> ndarray:
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == dtype else a.astype(dtype)
    return ndarray(np.array(a, dtype=dtype, order=order or "K", copy=True))


def _ascontiguousarray(a: Any, dtype: Any = None) -> ndarray:
    if isinstance(a, ndarray):
        if a._a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
            return a  # (CuPy returns the array itself: no kernel)
        _on_current_device(a)
        return ndarray(np.ascontiguousarray(a._a, dtype=dtype))
    return ndarray(np.array(a, dtype=dtype, order="C", copy=True))


def _from_dlpack(x: Any) -> ndarray:
    """Fake arrays, or producers whose DLPack device is CUDA and whose ``__dlpack__()``
    hands over a fake array (a test double for torch CUDA tensors and the like)."""
    if isinstance(x, ndarray):
        return x
    if hasattr(x, "__dlpack_device__") and x.__dlpack_device__()[0] == 2:
        got = x.__dlpack__()
        if isinstance(got, ndarray):
            return got
    raise TypeError("fakecupy.from_dlpack takes fake device arrays only")


def _get_array_module(*args: Any) -> Any:
    return module if any(isinstance(a, ndarray) for a in args) else np


def _alloc_pinned_memory(nbytes: int) -> bytearray:
    _PINNED.append(int(nbytes))
    return bytearray(nbytes)


_PINNED: list[int] = []  # sizes of the pinned allocations made (tests look at them)


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        attr = getattr(np, name)
        if callable(attr) and not isinstance(attr, type):
            if name not in FUNCTIONS:
                raise AttributeError(f"cupy.{name}: not in fakecupy.FUNCTIONS (check CuPy has it)")
            return _function(name, attr)  # functions and ufuncs
        return attr  # dtypes, constants


module = _Module("cupy", __doc__)
module.__name__ = "cupy"
module.ndarray = ndarray
module.ElementwiseKernel = ElementwiseKernel
module.RawModule = RawModule
module.asarray = _asarray
module.array = _asarray
module.ascontiguousarray = _ascontiguousarray
module.from_dlpack = _from_dlpack
module.get_array_module = _get_array_module
module.cuda = types.ModuleType("cupy.cuda")
module.cuda.runtime = types.SimpleNamespace(
    getDeviceCount=lambda: _Device.count, getDevice=lambda: _Device.current()
)
module.cuda.get_current_stream = lambda: _Stream()
module.cuda.Stream = _Stream
module.cuda.Device = _Device
module.cuda.alloc_pinned_memory = _alloc_pinned_memory
module.cuda.nccl = nccl
module.pinned_allocations = _PINNED
module.Stream = _Stream


def require_torch_cuda(xp: Any) -> Any:
    """PyTorch with CUDA, for tests on real CuPy; skip the test otherwise."""
    import pytest

    if xp is module:
        pytest.skip("torch CUDA tensors need a real GPU")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    return torch


@contextlib.contextmanager
def installed() -> Iterator[Any]:
    """Make ``import cupy`` (and sparsecoll's device dispatch) use the fake for a while."""
    from sparsecoll import _array

    names = ("cupy", "cupy.cuda", "cupy.cuda.nccl")
    saved = {name: sys.modules.get(name) for name in names}
    before = set(sys.modules)
    sys.modules.update({"cupy": module, "cupy.cuda": module.cuda, "cupy.cuda.nccl": nccl})
    _array.cupy_or_none.cache_clear()
    try:
        yield module
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
        # CuPy's own modules first imported while the fake stood in (by torch, say) may
        # hold the fake as `cupy`: forget them, so the real ones import afresh (on a GPU
        # machine a later NVRTC test once failed on "module 'numpy' has no attribute
        # '_environment'" after such an import)
        for name in set(sys.modules) - before:
            if name.split(".")[0] in ("cupy", "cupyx", "cupy_backends"):
                sys.modules.pop(name, None)
        _array.cupy_or_none.cache_clear()
