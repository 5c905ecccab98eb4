"""Array-module dispatch (numpy or CuPy) and host staging; the only module importing cupy.

torch tensors and JAX arrays are viewed as numpy (host) or CuPy (GPU) arrays, and results go
back to their kind (:func:`as_array`'s ``wrap``); torch and jax are imported only when such
an array comes.

Device support is optional: every CuPy object is reached through :func:`cupy_or_none`, so
the package imports and runs without CuPy or a GPU. Caches that hold CuPy objects (kernels)
are keyed by the module, so a test can swap the module (see ``tests/fakecupy.py``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Any

import numpy as np

__all__ = [
    "aligned_view",
    "as_array",
    "cupy_or_none",
    "device_scope",
    "get_array_module",
    "index_dtype",
    "is_device_array",
    "nccl_or_none",
    "nonzero_count",
    "nonzero_mask",
    "nonzero_positions",
    "pinned_empty",
    "same_device",
    "segment_sum",
    "synchronize",
    "to_host",
    "to_module",
]

INT32_LIMIT = 2**31 - 1

# DLPack device types (dlpack.h): CPU, CUDA, CUDA pinned host memory, CUDA managed memory.
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


@functools.cache
def cupy_or_none() -> Any:
    """Return the cupy module, or None when CuPy (or a GPU) is not available."""
    try:
        import cupy
    except Exception:
        return None
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
    except Exception:
        return None
    return cupy


def nccl_or_none() -> Any:
    """Return ``cupy.cuda.nccl`` when CuPy and the NCCL library are usable, else None."""
    cp = cupy_or_none()
    if cp is None:
        return None
    try:
        nccl = importlib.import_module(cp.__name__ + ".cuda.nccl")
    except Exception:
        return None
    return nccl if getattr(nccl, "available", True) else None


def is_device_array(x: Any) -> bool:
    """True for CuPy arrays and anything exposing ``__cuda_array_interface__``."""
    return hasattr(x, "__cuda_array_interface__")


def _dlpack_device_type(x: Any) -> int | None:
    try:
        return int(x.__dlpack_device__()[0])
    except Exception:
        return None


def as_array(x: Any, name: str, *, writable: bool = False) -> tuple[Any, Any]:
    """Return ``(array, wrap)``: a numpy/CuPy view of ``x``, and a function converting a
    result back to the caller's kind (torch in, torch out).

    Host arrays go through ``np.asarray`` or DLPack; device arrays (CUDA array interface or
    DLPack) through CuPy, without a copy, on their own device. numpy subclasses come back
    as plain ndarrays. An input in non-native byte order comes back as a native copy (MPI
    moves raw bytes). With ``writable`` (an output buffer) nothing is copied: what numpy
    could only copy (a list) is refused, since writes to the copy would be lost.

    Raises:
        TypeError: ``x`` cannot be viewed as an array (whatever the converter raised, so
            that callers agree on it across ranks as an input error; or None, a str, a
            dict), or is a masked array with masked entries (the mask would be ignored).
    """
    try:
        a, wrap = _as_array(x, name, writable)
    except TypeError:
        raise
    except Exception as exc:
        kind = type(x).__name__
        raise TypeError(f"{name}: cannot view this {kind} as an array ({exc})") from exc
    if isinstance(a, np.ndarray):
        a = _plain(a, name, writable)
        if not writable and not a.dtype.isnative:
            a = a.astype(a.dtype.newbyteorder("="))
    return a, wrap


def _plain(a: np.ndarray, name: str, writable: bool) -> np.ndarray:
    """Return ``a`` as a base-class ndarray (a view); masked entries are refused."""
    if isinstance(a, np.ma.MaskedArray):
        masked = int(np.count_nonzero(np.ma.getmaskarray(a)))
        if masked:
            hint = "" if writable else ": pass only the unmasked entries, or fill them"
            raise TypeError(
                f"{name}: a masked array with {masked} of {a.size} entries masked (its mask "
                f"would be ignored){hint}"
            )
        a = np.ma.getdata(a)
    return a if type(a) is np.ndarray else np.asarray(a)


def _no_copy(x: Any) -> np.ndarray:
    """Return ``x`` as a numpy array without a copy; ValueError when numpy could only copy."""
    if _NUMPY2:
        return np.asarray(x, copy=False)
    a = np.asarray(x)  # numpy 1.x has no copy=False meaning "never": a copy owns its data
    if isinstance(x, (list, tuple)) or (a is not x and a.flags.owndata):
        raise ValueError("a copy would be needed")
    return a


_NUMPY2 = int(np.__version__.split(".")[0]) >= 2


def _as_array(x: Any, name: str, writable: bool) -> tuple[Any, Any]:
    mod_name = type(x).__module__.split(".")[0]
    wrap = identity
    if mod_name in ("jax", "jaxlib"):
        wrap = _jax_wrapper(x, name)
        if _dlpack_device_type(x) == _DL_CPU:
            return np.asarray(x), wrap  # (a read-only view: JAX arrays are immutable)
    elif mod_name == "torch":
        wrap = _torch_wrap
        x = x.detach()
        if x.device.type == "cpu":
            try:
                return np.asarray(x), wrap
            except Exception as exc:  # e.g. bfloat16, which numpy has no type for
                raise TypeError(
                    f"{name}: numpy cannot take a {_torch_kind(x)} ({exc}){_torch_hint(x, name)}"
                ) from exc
    dl = _dlpack_device_type(x) if hasattr(x, "__dlpack_device__") else None
    if is_device_array(x) or dl in (_DL_CUDA, _DL_CUDA_MANAGED):
        cp = cupy_or_none()
        if cp is None:
            raise TypeError(f"{name} lives on a GPU, but CuPy is not available")
        if isinstance(x, cp.ndarray):
            return x, wrap
        try:
            # DLPack first: it carries the producer's stream, so CuPy waits for it.
            if dl in (_DL_CUDA, _DL_CUDA_MANAGED):
                return cp.from_dlpack(x), wrap
            return cp.asarray(x), wrap
        except Exception as exc:  # e.g. bfloat16, which CuPy has no type for
            raise TypeError(f"{name}: CuPy cannot take this device array ({exc})") from exc
    if isinstance(x, np.ndarray):
        return x, wrap
    if writable:
        try:
            return _no_copy(x), wrap
        except ValueError:  # numpy could only copy it: writes to the copy would be lost
            kind = type(x).__name__
            raise TypeError(f"{name} must be an array written in place, got a {kind}") from None
    try:
        a = np.asarray(x)
    except Exception:
        if not hasattr(x, "__dlpack__"):
            raise
        a = None
    if a is None or (a.ndim == 0 and a.dtype.kind in "OSUV"):
        # numpy wraps what it cannot read as an array (None, a str, a dict, an object that
        # offers DLPack alone) in a 0-d array: a type error, not a shape error
        if hasattr(x, "__dlpack__"):
            return np.from_dlpack(x), wrap
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    return a, wrap


def _torch_kind(x: Any) -> str:
    """Describe a tensor as ``torch.float32 tensor``, with its layout when not strided."""
    layout = str(x.layout).removeprefix("torch.")
    return f"{x.dtype} tensor" + ("" if layout == "strided" else f" of layout {layout}")


def _torch_hint(x: Any, name: str) -> str:
    """Return a hint on what to pass instead of the torch tensor ``x`` numpy refused.

    A sparse tensor's values and indices; a float type numpy lacks (bfloat16, float8) widened.
    """
    import torch

    if x.layout != torch.strided:
        return (
            "; for a 1-D sparse COO tensor t, pass its entries: t = t.coalesce(), then "
            "t.values() as the values and t.indices()[0] as the indices"
        )
    numpy_has = (torch.float16, torch.float32, torch.float64)
    if x.is_floating_point() and x.dtype not in numpy_has and name != "indices":
        return "; widen it to float32 first (tensor.float())"
    return ""


def identity(a: Any) -> Any:
    return a


def _torch_wrap(a: Any) -> Any:
    import torch

    return torch.from_dlpack(a)


def _jax_wrapper(x: Any, name: str) -> Any:
    """Return the function giving a result back as a ``jax.Array`` on ``x``'s device."""
    import jax

    if isinstance(x, jax.core.Tracer):
        raise TypeError(
            f"{name}: a traced JAX array (inside jax.jit, grad or vmap): the library needs "
            "concrete values; inside jit, use sparsecoll.integrations.jax"
        )
    if not isinstance(x, jax.Array):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    devices = x.devices()
    if len(devices) != 1:
        raise TypeError(
            f"{name}: a jax.Array on {len(devices)} devices; pass one device's array "
            "(e.g. x.addressable_shards[0].data)"
        )
    return functools.partial(_jax_wrap, device=next(iter(devices)))


def _jax_wrap(a: Any, device: Any) -> Any:
    """Return ``a`` (numpy or CuPy) as a ``jax.Array`` on ``device``: without a copy through
    DLPack where JAX allows it (a GPU array; a host array 64-byte aligned)."""
    import jax

    out = jax.dlpack.from_dlpack(a)
    return out if out.devices() == {device} else jax.device_put(out, device)


def fresh(wrap: Any, a: Any) -> Any:
    """``wrap(a)`` of a buffer the library reuses: a JAX array gets a copy (it is immutable)."""
    if isinstance(wrap, functools.partial) and wrap.func is _jax_wrap:
        a = a.copy()
    return wrap(a)


def nonzero_mask(x: Any) -> Any:
    """Return ``x != 0``; a float32 device array is tested on its bits (CuPy flushes subnormals)."""
    if isinstance(x, np.ndarray) or x.dtype != np.float32:
        return x != 0
    return (x.view(np.uint32) & np.uint32(0x7FFF_FFFF)) != np.uint32(0)


def nonzero_positions(x: Any) -> Any:
    """Return ``flatnonzero(x)`` of a 1-D array, float32 subnormals counted on a GPU too;
    of a 2-D array, the rows holding a nonzero."""
    xp = get_array_module(x)
    return xp.flatnonzero(_nonzero_rows(x, xp))


def nonzero_count(x: Any) -> int:
    """Return ``count_nonzero(x)``, float32 subnormals counted on a GPU too; of a 2-D array,
    how many rows hold a nonzero."""
    xp = get_array_module(x)
    return int(xp.count_nonzero(_nonzero_rows(x, xp)))


def _nonzero_rows(x: Any, xp: Any) -> Any:
    """``x`` (1-D) or which of its rows hold a nonzero (2-D), as flatnonzero can read it."""
    nz = x if xp is np or x.dtype != np.float32 else nonzero_mask(x)
    return nz.any(axis=1) if x.ndim == 2 else nz


def get_array_module(x: Any) -> Any:
    """Return numpy for host arrays, cupy for device arrays."""
    if isinstance(x, np.ndarray):
        return np
    cp = cupy_or_none()
    if cp is not None and isinstance(x, cp.ndarray):
        return cp
    return np


def device_scope(x: Any) -> Any:
    """Return a context in which new CuPy arrays land on ``x``'s device (no-op on the host)."""
    cp = cupy_or_none()
    if cp is not None and isinstance(x, cp.ndarray):
        return x.device
    return contextlib.nullcontext()


def same_device(a: Any, b: Any) -> bool:
    """Whether arrays ``a`` and ``b`` are both host arrays or both on one GPU."""
    xp = get_array_module(a)
    if get_array_module(b) is not xp:
        return False
    return xp is np or a.device.id == b.device.id


def synchronize() -> None:
    """Wait for the current CUDA stream (before MPI or the host touches device memory)."""
    cp = cupy_or_none()
    if cp is not None:
        cp.cuda.get_current_stream().synchronize()


def wait_for_foreign(given: Any, view: Any) -> None:
    """Hand ``given`` (an ``out`` written through ``view``) back to the library that owns it.

    When ``view`` is CuPy's view of another library's device array, CuPy's stream is
    synchronized (nothing orders the owner's stream after it). A torch tensor's version counter
    is raised, as torch's in-place writes do, so that autograd sees the write.
    """
    if given is None or given is view:
        return
    if is_device_array(view):
        synchronize()
    if type(given).__module__.split(".")[0] == "torch":
        import torch

        bump = getattr(torch.autograd.graph, "increment_version", None)  # torch >= 2.1
        if bump is not None:
            bump(given)


def to_host(x: Any) -> np.ndarray:
    """Copy a device array to the host; return host arrays unchanged."""
    if isinstance(x, np.ndarray):
        return x
    return x.get()


def to_module(x: np.ndarray, xp: Any) -> Any:
    """Move a host array to the module ``xp`` (no-op for numpy)."""
    if xp is np:
        return x
    return xp.asarray(x)


def pinned_empty(nbytes: int) -> np.ndarray:
    """Return a host uint8 array of ``nbytes``, page-locked (fast device copies) with CuPy."""
    cp = cupy_or_none()
    if cp is None or nbytes == 0:
        return np.empty(nbytes, dtype=np.uint8)
    mem = cp.cuda.alloc_pinned_memory(nbytes)
    return np.frombuffer(mem, dtype=np.uint8, count=nbytes)


def _address(a: Any) -> int:
    if isinstance(a, np.ndarray):
        return int(a.__array_interface__["data"][0])
    return int(a.__cuda_array_interface__["data"][0])


def aligned_view(buf: Any, dtype: Any) -> Any:
    """View the byte array ``buf`` as ``dtype``, copied first if misaligned (GPUs fault on it)."""
    dtype = np.dtype(dtype)
    if buf.shape[0] and _address(buf) % dtype.itemsize:
        buf = buf.copy()
    return buf.view(dtype)


def index_dtype(n: int) -> np.dtype:
    """Return the index type for a vector of length ``n``: int32 while every index fits."""
    return np.dtype(np.int32) if n <= INT32_LIMIT + 1 else np.dtype(np.int64)


RADIX_BITS = 12  # digit of the host's index sort: 4096 counters fit in L1
RADIX_MIN = 1 << 12  # shorter index arrays go to numpy's sort


def stable_argsort(keys: Any, n: int) -> Any:
    """Return ``argsort(keys, kind="stable")`` for integer keys in ``[0, n)``.

    Long host arrays get an LSD radix sort in Numba (ceil(log2 n / 12) passes).
    """
    xp = get_array_module(keys)
    m = int(keys.shape[0])
    if xp is not np or m < RADIX_MIN or n <= 1:
        return xp.argsort(keys, kind="stable")
    bits = int(n - 1).bit_length()
    return _radix_argsort_kernel()(np.ascontiguousarray(keys), bits, RADIX_BITS)


@functools.cache
def _radix_argsort_kernel() -> Any:
    from ._jit import cached_njit

    @cached_njit(nogil=True)
    def radix_argsort(keys, bits, digit):  # pragma: no cover - compiled
        # LSD radix sort of (key, position) pairs, `digit` bits a pass: stable, so equal
        # keys keep their input order
        m = keys.shape[0]
        size = 1 << digit
        mask = size - 1
        key = keys.astype(np.int64)
        pos = np.arange(m)
        key2 = np.empty(m, np.int64)
        pos2 = np.empty(m, np.int64)
        count = np.empty(size + 1, np.int64)
        shift = 0
        while shift < bits:
            count[:] = 0
            for i in range(m):
                count[((key[i] >> shift) & mask) + 1] += 1
            for d in range(size):
                count[d + 1] += count[d]
            for i in range(m):
                d = (key[i] >> shift) & mask
                j = count[d]
                key2[j] = key[i]
                pos2[j] = pos[i]
                count[d] = j + 1
            key, key2 = key2, key
            pos, pos2 = pos2, pos
            shift += digit
        return pos

    return radix_argsort


def segment_sum(vals: Any, heads: Any) -> Any:
    """Sum ``vals`` over the segments starting at ``heads``, each from its first value.

    ``heads`` is strictly ascending from 0 (so -0.0 + -0.0 is -0.0). Each segment is summed
    in order, without atomics, so every rank summing the same data gets the same bits.
    Rows (2-D ``vals``) are summed elementwise, each column in that order.
    """
    if isinstance(vals, np.ndarray):
        return np.add.reduceat(vals, heads, axis=0)
    cp = cupy_or_none()
    heads = heads.astype(np.int64, copy=False)
    ends = cp.empty_like(heads)
    ends[:-1] = heads[1:]
    ends[-1] = vals.shape[0]
    if vals.ndim == 2:
        width = vals.shape[1]
        out = cp.empty((heads.shape[0], width), dtype=vals.dtype)
        kernel = _segment_sum_rows_kernel(cp)
        kernel(cp.ascontiguousarray(vals), heads[:, None], ends[:, None], width, out)
        return out
    out = cp.empty(heads.shape[0], dtype=vals.dtype)
    _segment_sum_kernel(cp)(vals, heads, ends, out)
    return out


# CuPy compiles every kernel with -ftz=true (cupy/cuda/compiler.py): float32 additions and
# products then flush subnormal operands and results to 0, which the host never does.
# sc_add and sc_mul round once in IEEE arithmetic whatever that flag (PTX without .ftz;
# float64 never flushes) and are never fused into an FMA. The template serves other types
# (float16: CuPy's own operators). sc_widen: float32 to float64 exactly (a plain cast
# compiles to cvt.ftz.f64.f32).
IEEE_ARITHMETIC = r"""
template <typename X> __device__ __forceinline__ X sc_add(X a, X b) { return a + b; }
template <typename X> __device__ __forceinline__ X sc_mul(X a, X b) { return a * b; }
__device__ __forceinline__ float sc_add(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float sc_mul(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ double sc_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double sc_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double sc_widen(float a) {
    double r;
    asm("cvt.f64.f32 %0, %1;" : "=d"(r) : "f"(a));
    return r;
}
"""


@functools.cache
def _segment_sum_kernel(cp: Any) -> Any:
    # one thread per segment: out[i] = sum of v[h[i]:e[i]] in index order, from its first
    # value as numpy's reduceat (starting from 0 would turn -0.0 sums into +0.0)
    return cp.ElementwiseKernel(
        "raw T v, int64 h, int64 e",
        "T out",
        "T acc = v[h]; for (long long j = h + 1; j < e; ++j) acc = sc_add(acc, v[j]); out = acc;",
        "sparsecoll_segment_sum",
        preamble=IEEE_ARITHMETIC,
    )


@functools.cache
def _segment_sum_rows_kernel(cp: Any) -> Any:
    # one thread per segment and column of C-contiguous rows of width d, as above
    return cp.ElementwiseKernel(
        "raw T v, int64 h, int64 e, int64 d",
        "T out",
        "long long c = i % d; T acc = v[h * d + c];"
        " for (long long j = h + 1; j < e; ++j) acc = sc_add(acc, v[j * d + c]); out = acc;",
        "sparsecoll_segment_sum_rows",
        preamble=IEEE_ARITHMETIC,
    )
