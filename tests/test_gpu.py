"""Device code in one process: GPU selection, device arrays through SparseVector and the
array helpers, on the strict fake CuPy (always) and on real CuPy (only with a GPU).

On the fake, the selection tests check the radix-select logic around the histogram kernel
(re-stated in numpy there); on a GPU they check the CUDA kernel itself, and compare with
``torch.topk`` when PyTorch sees the GPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparsecoll import SparseVector
from sparsecoll._array import aligned_view, as_array, cupy_or_none, index_dtype
from sparsecoll.algorithms.base import pack_pairs, unpack_pairs
from sparsecoll.sparse import coalesce

from . import fakecupy


def _real_cupy():
    cp = pytest.importorskip("cupy")
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception:
        count = 0
    if count < 1:
        pytest.skip("no CUDA device")
    cupy_or_none.cache_clear()
    return cp


@pytest.fixture(scope="module", params=["fake", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request):
    if request.param == "fake":
        with fakecupy.installed() as fake:
            yield fake
    else:
        yield _real_cupy()


@pytest.fixture(scope="module")
def sel(xp):
    from sparsecoll.select import _cupy

    return _cupy


DTYPES = [np.float16, np.float32, np.float64]


@st.composite
def vectors(draw, max_n: int = 3000) -> np.ndarray:
    """Float vectors with the hard cases: many ties, zeros of both signs, infinities."""
    n = draw(st.integers(0, max_n))
    dtype = draw(st.sampled_from(DTYPES))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["normal", "ties", "zeros", "wide", "inf"]))
    if kind == "ties":
        x = rng.integers(-3, 4, n).astype(dtype)
    elif kind == "zeros":
        x = (rng.standard_normal(n) * (rng.random(n) < 0.05)).astype(dtype)
        x[rng.random(n) < 0.5] *= -1  # -0.0 and 0.0 mixed
    elif kind == "wide":
        with np.errstate(over="ignore", under="ignore"):
            x = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(dtype)
    else:
        x = rng.standard_normal(n).astype(dtype)
    if kind == "inf" and n:
        x[rng.integers(0, n, 3)] = np.inf
        x[rng.integers(0, n, 2)] = -np.inf
    return x


def reference_topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest |x|, ties by lower index, ascending."""
    order = np.lexsort((np.arange(x.shape[0]), -np.abs(x.astype(np.float64))))
    return np.sort(order[: max(0, min(k, x.shape[0]))])


def test_fake_refuses_host_device_mixing():
    """The fake is only useful if it catches what CuPy would reject."""
    with fakecupy.installed() as fake:
        d = fake.asarray(np.arange(4.0))
        with pytest.raises(TypeError):
            np.asarray(d)
        with pytest.raises(TypeError):
            d + np.ones(4)
        with pytest.raises(TypeError):
            np.concatenate([d, np.ones(2)])
        with pytest.raises(TypeError):
            d[np.array([1])]
        with pytest.raises(TypeError):
            d[:2] = np.ones(2)
        assert isinstance(d.sum(), fake.ndarray)  # reductions stay on the device, as 0-d
        assert cupy_or_none() is fake
    assert cupy_or_none() is not fake


def test_fake_is_no_more_permissive_than_cupy():
    """What the fake offers, an installed CuPy offers too (no GPU needed): the functions it
    passes on to numpy with their keywords (fakecupy.FUNCTIONS), and its arrays' methods and
    protocols. CuPy's ndarray has no ``__index__``, for one: a 0-d device array is no slice
    bound on a GPU, so it must not be one on the fake."""
    import inspect
    import operator

    with fakecupy.installed() as fake:
        with pytest.raises(TypeError):
            operator.index(fake.asarray(np.arange(3)).sum())
        with pytest.raises(AttributeError):
            fake.lexsort  # noqa: B018  (numpy has it; the fake offers only what is listed)
        with pytest.raises(TypeError, match="equal_nan"):
            fake.searchsorted(fake.arange(3), fake.arange(2), equal_nan=True)
    cp = pytest.importorskip("cupy")
    for name, keywords in fakecupy.FUNCTIONS.items():
        fn = getattr(cp, name, None)
        assert fn is not None, f"cupy has no {name}"
        if isinstance(fn, cp.ufunc):
            assert set(keywords) <= {"out", "casting", "dtype"}, name
            continue
        params = inspect.signature(fn).parameters
        assert set(keywords) <= set(params), (name, set(keywords) - set(params))
    own = {k for k in vars(fakecupy.ndarray) if not k.startswith("_") or k.endswith("__")}
    own -= {"__module__", "__doc__", "__slots__", "__init__", "__getattr__", "__repr__"}
    own -= {"__array__", "__array_ufunc__", "__array_function__"}  # (refusals, dispatch)
    missing = sorted(k for k in own if not hasattr(cp.ndarray, k))
    assert not missing, f"the fake's arrays have what cupy.ndarray lacks: {missing}"


@given(x=vectors(), k=st.integers(-1, 3100))
def test_topk_exact(xp, sel, x, k):
    idx, vals = sel.topk(xp.asarray(x), k)
    assert isinstance(idx, xp.ndarray)
    assert isinstance(vals, xp.ndarray)
    assert idx.dtype == index_dtype(x.shape[0])
    assert vals.dtype == x.dtype
    want = reference_topk(x, k)
    np.testing.assert_array_equal(idx.get(), want)
    np.testing.assert_array_equal(vals.get(), x[want])


@given(x=vectors(), k=st.integers(1, 3100), cap=st.sampled_from([0, 1, 5]))
def test_topk_exact_through_every_digit(xp, sel, x, k, cap):
    """With a tiny candidate cap the radix select refines digit after digit (12 bits a
    pass) down to one key, and cuts the ties there by index: the paths that skewed
    or tied data of millions of entries take."""
    k = min(k, x.shape[0])
    if k == 0 or k == x.shape[0]:
        return
    saved = sel._CANDIDATES
    sel._CANDIDATES = cap
    try:
        idx, _ = sel.topk(xp.asarray(x), k)
        kth = sel.kth_largest_abs(xp.asarray(x), k)
    finally:
        sel._CANDIDATES = saved
    want = reference_topk(x, k)
    np.testing.assert_array_equal(idx.get(), want)
    assert kth == float(np.sort(np.abs(x.astype(np.float64)))[::-1][k - 1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_cuts_a_large_tie_without_gathering_it(xp, sel, monkeypatch, dtype):
    """More ties at the k-th value than _CANDIDATES: the radix select reaches the last
    digit, whose bin is one key, and finds the last tie kept by counting ties per tile.
    It used to gather the whole tied group with int64 indices and sort it twice (~1.2 GB
    for 100M equal float32 values)."""
    n = 3 * 4096 + 77  # several tiles, the last one partial
    x = np.full(n, -2.5, dtype=dtype)
    x[np.random.default_rng(5).integers(0, n, 40)] = 7.0
    monkeypatch.setattr(sel, "_CANDIDATES", 1000)
    launched = []
    kernel = sel.kernel
    monkeypatch.setattr(
        sel, "kernel", lambda cp, name, *a: launched.append(name) or kernel(cp, name, *a)
    )
    for k in (41, 4096, 4097, 9000, n - 1):
        idx, vals = sel.topk(xp.asarray(x), k)
        want = reference_topk(x, k)
        np.testing.assert_array_equal(idx.get(), want)
        np.testing.assert_array_equal(vals.get(), x[want])
        assert sel.kth_largest_abs(xp.asarray(x), k) == 2.5
    assert "sc_gather" not in launched and "sc_count" in launched


@given(n=st.integers(0, 20000), p=st.sampled_from([0.0, 0.001, 0.3, 1.0]), seed=st.integers(0, 99))
def test_flatnonzero_mask(xp, sel, n, p, seed):
    """The two-pass compaction of a bool mask equals flatnonzero, over many tiles, and on
    a slice that starts inside a tile."""
    mask = np.random.default_rng(seed).random(n) < p
    got = sel.flatnonzero_mask(xp.asarray(mask))
    assert got.dtype == index_dtype(n)
    np.testing.assert_array_equal(got.get(), np.flatnonzero(mask))
    lo = n // 3
    np.testing.assert_array_equal(
        sel.flatnonzero_mask(xp.asarray(mask)[lo:]).get(), np.flatnonzero(mask[lo:])
    )


@given(x=vectors(), data=st.data())
def test_threshold_count_kth(xp, sel, x, data):
    n = x.shape[0]
    absx = np.abs(x.astype(np.float64))
    candidates = [0.0, -1.0, 1e-3, 0.5, 1.0, 7.0, 1e300, float("inf")]
    if n:
        v = float(absx[data.draw(st.integers(0, n - 1))])
        candidates += [v, np.nextafter(v, np.inf), np.nextafter(v, -np.inf)]
    t = data.draw(st.sampled_from(candidates))
    idx, vals = sel.threshold(xp.asarray(x), t)
    want = np.flatnonzero(absx >= t)  # the comparison in float64: exact for every dtype
    np.testing.assert_array_equal(idx.get(), want)
    np.testing.assert_array_equal(vals.get(), x[want])
    assert idx.dtype == index_dtype(n)
    assert sel.count_ge(xp.asarray(x), t) == want.shape[0]
    if n:
        k = data.draw(st.integers(1, n))
        kth = sel.kth_largest_abs(xp.asarray(x), k)
        assert kth == np.sort(absx)[::-1][k - 1]
        assert sel.count_ge(xp.asarray(x), kth) >= k
    else:
        assert sel.kth_largest_abs(xp.asarray(x), 1) == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", [0, 500, 999])
def test_nan_raises_everywhere(xp, sel, dtype, where):
    """A NaN anywhere is an error for every function and every k or t, never dropped."""
    x = np.random.default_rng(3).standard_normal(1000).astype(dtype)
    x[where] = np.nan
    d = xp.asarray(x)
    for call in (
        lambda: sel.topk(d, 10),
        lambda: sel.topk(d, 0),
        lambda: sel.topk(d, 1000),
        lambda: sel.threshold(d, 0.5),
        lambda: sel.threshold(d, 1e9),
        lambda: sel.count_ge(d, 0.0),
        lambda: sel.kth_largest_abs(d, 3),
        lambda: sel.moments(d),
    ):
        with pytest.raises(ValueError, match="NaN"):
            call()
    with pytest.raises(ValueError, match="NaN"):
        sel.threshold(xp.asarray(np.ones(3, dtype)), float("nan"))


@given(x=vectors())
def test_moments(xp, sel, x):
    if x.shape[0] == 0:
        with pytest.raises(ValueError, match="empty"):
            sel.moments(xp.asarray(x))
        return
    v = x.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf on the fake's numpy
        mean, std = sel.moments(xp.asarray(x))
        want_mean = float(v.sum()) / v.shape[0]
        want_var = max(float(np.dot(v, v)) / v.shape[0] - want_mean**2, 0.0)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-9, atol=1e-300)
    np.testing.assert_allclose(std, want_var**0.5, rtol=1e-6, atol=1e-300)


@pytest.mark.parametrize("dtype", DTYPES)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 3000), offset=st.floats(1.0, 12.0))
def test_moments_with_a_large_offset(xp, sel, dtype, seed, n, offset):
    """|mean| >> std: the std is the two-pass one (long double), as on the CPU (before:
    E[x²] - mean², 0 or orders of magnitude off from an offset of ~1e7 std on)."""
    top = {np.float16: 3.0, np.float32: 6.0, np.float64: 14.0}[dtype]
    x = (10.0 ** min(offset, top) + np.random.default_rng(seed).standard_normal(n)).astype(dtype)
    v = x.astype(np.longdouble)
    want = float(np.sqrt(np.mean((v - v.mean()) ** 2)))
    mean, std = sel.moments(xp.asarray(x))
    np.testing.assert_allclose(mean, float(v.mean()), rtol=1e-13, atol=1e-9 * want)
    np.testing.assert_allclose(std, want, rtol=1e-9, atol=1e-300)


def test_selection_rejects_bad_input(xp, sel):
    with pytest.raises(TypeError, match="float16, float32 or float64"):
        sel.topk(xp.asarray(np.arange(5)), 2)
    with pytest.raises(ValueError, match="1-D"):
        sel.threshold(xp.asarray(np.ones((2, 2), np.float32)), 0.5)


def test_topk_strided_input(xp, sel):
    x = np.random.default_rng(1).standard_normal(1001).astype(np.float32)
    idx, _vals = sel.topk(xp.asarray(x)[::2], 17)
    want = reference_topk(x[::2], 17)
    np.testing.assert_array_equal(idx.get(), want)


@given(
    n=st.integers(1, 5000),
    m=st.integers(0, 400),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**32 - 1),
)
def test_coalesce_on_device_equals_host(xp, n, m, dtype, seed):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, min(n, max(1, m // 3)), m)  # many repeats
    vals = rng.standard_normal(m).astype(dtype)
    host = coalesce(idx, vals, n)
    dev = SparseVector.from_coo(xp.asarray(idx), xp.asarray(vals), n)
    assert isinstance(dev.values, xp.ndarray)
    assert dev.xp is xp
    np.testing.assert_array_equal(dev.indices.get(), host.indices)
    tol = 1e-2 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(
        dev.values.get().astype(np.float64), host.values.astype(np.float64), rtol=tol, atol=tol
    )
    dense = dev.to_dense()
    assert isinstance(dense, xp.ndarray)
    back = SparseVector.from_dense(dense)
    assert isinstance(back.indices, xp.ndarray)
    assert back.indices.dtype == index_dtype(n)


def test_to_dense_fills_a_device_out(xp):
    """to_dense(out=) on the device: a device array filled and returned; a host array for a
    device vector refused (writes to a host copy would be lost)."""
    v = SparseVector.from_coo(xp.asarray([4, 1, 4]), xp.asarray([1.0, 2.0, 3.0]), 6)
    out = xp.asarray(np.full(6, 9.0))
    assert v.to_dense(out=out) is out
    assert out.get().tolist() == [0.0, 2.0, 0.0, 0.0, 4.0, 0.0]
    with pytest.raises(TypeError, match="where the values do"):
        v.to_dense(out=np.zeros(6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_coalesce_on_device_keeps_the_sign_of_zero(xp, dtype):
    """Duplicates sum from their first value, as numpy's reduceat: -0.0 + -0.0 is -0.0 on
    the device too (its kernel once started each segment from +0, so gave +0.0)."""
    idx = np.array([1, 1, 3, 5, 5, 5, 6, 6])
    vals = np.array([-0.0, -0.0, 2.0, -0.0, -0.0, -0.0, -0.0, 0.0], dtype=dtype)
    host = coalesce(idx, vals, 8)
    dev = coalesce(xp.asarray(idx), xp.asarray(vals), 8)
    np.testing.assert_array_equal(dev.indices.get(), host.indices)
    np.testing.assert_array_equal(np.signbit(dev.values.get()), np.signbit(host.values))
    np.testing.assert_array_equal(np.signbit(host.values), [True, False, True, False])


@pytest.mark.parametrize("m", [0, 1, 4, 7])
def test_pair_buffers_unpack_aligned(xp, m):
    """int32 indices then float64 values: an odd count leaves the values misaligned."""
    idx = xp.asarray(np.arange(m, dtype=np.int32) * 3)
    vals = xp.asarray(np.arange(m, dtype=np.float64) / 7)
    buf = pack_pairs(idx, vals)
    assert isinstance(buf, xp.ndarray)
    assert buf.dtype == np.uint8
    i2, v2 = unpack_pairs(buf, np.int32, np.float64)
    np.testing.assert_array_equal(i2.get(), idx.get())
    np.testing.assert_array_equal(v2.get(), vals.get())
    if m:
        assert v2.__cuda_array_interface__["data"][0] % 8 == 0
    # a byte buffer at an odd offset is copied before viewing
    wide = xp.zeros(17, dtype=np.uint8)
    view = aligned_view(wide[1:9], np.float64)
    assert view.__cuda_array_interface__["data"][0] % 8 == 0
    assert view.shape == (1,)


def test_as_array_keeps_device_arrays(xp):
    d = xp.asarray(np.arange(3.0))
    arr, wrap = as_array(d, "values")
    assert arr is d
    assert wrap(arr) is arr
    host, _ = as_array([1.0, 2.0], "values")
    assert isinstance(host, np.ndarray)


class _CudaProducer:
    """A DLPack producer on CUDA device 0 (like a torch CUDA tensor), for the fake."""

    def __init__(self, payload):
        self.payload = payload

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None):
        return self.payload


def test_as_array_takes_cuda_dlpack_producers(xp):
    if xp is not fakecupy.module:
        pytest.skip("the fake's DLPack double; real producers are covered by the torch tests")
    d = xp.asarray(np.arange(4.0))
    arr, wrap = as_array(_CudaProducer(d), "values")
    assert arr is d
    assert wrap(arr) is arr  # not torch: results stay CuPy arrays


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_writes_into_a_foreign_device_out_are_waited_for(xp, dtype):
    """An ``out`` that is another library's device array (torch CUDA tensors) is written by
    CuPy kernels on CuPy's stream, which nothing orders the owner's stream after (DLPack
    orders only arrays handed *to* a consumer): to_dense(out=) and a one-rank
    Communicator.allreduce(out=, op="mean") return with no work pending, as
    GradientReducer.step(out=) does. Both used to return with their last kernels (the
    scatter; the mean's division, float16's cast into out) still queued."""
    if xp is not fakecupy.module:
        pytest.skip("the fake's DLPack double and its record of queued work")
    from mpi4py import MPI

    from sparsecoll import Communicator, GradientReducer

    v = SparseVector(xp.asarray(np.array([1, 5])), xp.asarray(np.array([2.0, -3.0], dtype)), 8)
    dense = xp.zeros(8, dtype)
    assert v.to_dense(out=_CudaProducer(dense)) is not None and not fakecupy._Stream.pending()
    assert dense.get().tolist() == [0, 2, 0, 0, 0, -3, 0, 0]
    comm = Communicator(MPI.COMM_SELF)
    got = xp.zeros(8, dtype)
    comm.allreduce(_CudaProducer(dense), out=_CudaProducer(got), op="mean")
    assert not fakecupy._Stream.pending()
    assert got.get().tolist() == dense.get().tolist()
    red = GradientReducer(comm, 8, algorithm="allgather", density=0.25)
    red.step(_CudaProducer(dense), out=_CudaProducer(got))
    assert not fakecupy._Stream.pending()


def test_topk_agrees_with_torch(xp, sel):
    torch = fakecupy.require_torch_cuda(xp)
    x = xp.random.standard_normal(1_000_003, dtype=np.float32)  # distinct values: no ties
    for k in (1, 1000, 100_000):
        idx, _ = sel.topk(x, k)
        t = torch.from_dlpack(x)
        ref = torch.topk(t.abs(), k, sorted=False).indices
        assert np.array_equal(idx.get(), np.sort(ref.cpu().numpy()))


def test_torch_cuda_tensor_round_trip(xp):
    torch = fakecupy.require_torch_cuda(xp)
    t = torch.arange(5, dtype=torch.float32, device="cuda")
    arr, wrap = as_array(t, "values")
    assert isinstance(arr, xp.ndarray)
    back = wrap(arr * 2)
    assert isinstance(back, torch.Tensor)
    assert back.device == t.device
    assert torch.equal(back, t * 2)


def test_gpu_select_bench_runs(xp, capsys):
    """The benchmark's code path (on the fake its timings mean nothing and are not kept)."""
    from sparsecoll.benchmarks import gpu

    n = "2000,30000" if xp is fakecupy.module else "1M"
    assert gpu.main(["select", "-n", n, "-i", "2", "-x", "1", "--no-torch", "--format", "csv"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("n,density,k,selected,method")
    assert len(lines) == 1 + len(n.split(",")) * 2 * 3


_HARNESS = r"""
%(preamble)s
template <typename X> struct Raw {
  X* p;
  __device__ X& operator[](long long i) const { return p[i]; }
};
typedef %(U)s U;
typedef %(T)s T;
extern "C" __global__ void %(name)s(%(params)s, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)blockDim.x * gridDim.x) {
    %(prep)s
    %(op)s
  }
}
"""
_CTYPES = {
    "int32": "int",
    "int64": "long long",
    "uint64": "unsigned long long",
    "bool": "bool",
    "float32": "float",
    "float64": "double",
    "U": "U",
    "T": "T",
}


def _kernel_source(spec, utype: str, ttype: str) -> str:
    """CUDA source shaped like CuPy's ElementwiseKernel code: raw parameters indexable,
    array parameters bound by reference to element i, scalars by value."""
    in_params, out_params, operation, name, preamble = spec
    params, prep = [], []
    for text, is_out in [(p, False) for p in in_params.split(",")] + [
        (p, True) for p in out_params.split(",")
    ]:
        words = text.split()
        raw = words[0] == "raw"
        typ, nm = words[-2:]
        ctype = _CTYPES[typ]
        const = "" if is_out else "const "
        if raw:
            params.append(f"Raw<{ctype}> {nm}")
        elif is_out or nm in ("bits", "h", "e"):
            params.append(f"{const}{ctype}* _raw_{nm}")
            prep.append(f"{const}{ctype} &{nm} = _raw_{nm}[i];")
        else:
            params.append(f"const {ctype} {nm}")
    return _HARNESS % {
        "preamble": preamble,
        "U": utype,
        "T": ttype,
        "name": name,
        "params": ", ".join(params),
        "prep": " ".join(prep),
        "op": operation,
    }


def test_kernel_sources_compile_with_nvrtc():
    """Compile the bodies of sparsecoll's CUDA kernels with NVRTC (no GPU needed) for every
    key width, so a type or overload error shows up wherever CuPy's NVRTC loads."""
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    try:
        nvrtc.getVersion()
    except Exception as exc:
        pytest.skip(f"NVRTC not loadable: {exc}")
    from sparsecoll import _array
    from sparsecoll.select import _cupy_kernels

    class Capture:
        def __init__(self):
            self.options = {}  # compiler options by kernel name

        def ElementwiseKernel(self, *spec, options=(), preamble=""):
            self.options[spec[3]] = list(options)
            return (*spec, preamble)

    cap = Capture()
    # the selection kernels (a RawModule per key and index width)
    for key_bytes in (2, 4, 8):
        for index_bytes in (4, 8):
            source = _cupy_kernels.kernel_source(key_bytes, index_bytes)
            prog = nvrtc.createProgram(source, "select.cu", [], [])
            try:
                nvrtc.compileProgram(prog, [*_cupy_kernels.KERNEL_OPTIONS, "-arch=compute_90"])
            except Exception:
                pytest.fail(
                    f"selection kernels ({key_bytes}, {index_bytes}):\n{nvrtc.getProgramLog(prog)}"
                )
            ptx = nvrtc.getPTX(prog)
            for name in (
                "sc_hist",
                "sc_gather",
                "sc_count",
                "sc_write",
                "sc_gather_packed",
                "sc_take_packed",
                "sc_mask_count",
                "sc_mask_write",
            ):
                assert name.encode() in ptx, name
    jobs = [
        (_array._segment_sum_kernel.__wrapped__(cap), "unsigned int", t)
        for t in ("float", "double")
    ]
    jobs += [
        (_cupy_kernels.accumulate_kernel.__wrapped__(cap, has_r, has_u), "unsigned int", t)
        for has_r in (False, True)
        for has_u in (False, True)
        for t in ("float", "double")  # float16 takes CuPy's ufuncs, not this kernel
    ]
    jobs.append((_cupy_kernels.widen_kernel.__wrapped__(cap), "unsigned int", "float"))
    for spec, utype, ttype in jobs:
        prog = nvrtc.createProgram(_kernel_source(spec, utype, ttype), "k.cu", [], [])
        try:
            nvrtc.compileProgram(
                prog, ["--std=c++17", "-arch=compute_90", *cap.options.get(spec[3], [])]
            )
        except Exception:
            pytest.fail(f"{spec[3]} ({utype}, {ttype}):\n{nvrtc.getProgramLog(prog)}")
        assert len(nvrtc.getPTX(prog)) > 100


def _cupy_codegen():
    """CuPy's own source generator and NVRTC driver, if this CuPy has them (private API:
    cupy._core._kernel, cupy._core.core, cupy.cuda.compiler as of CuPy 14)."""
    cp = pytest.importorskip("cupy")
    try:
        from cupy._core import _carray, _kernel, _scalar, core
        from cupy.cuda import compiler

        compiler._get_nvrtc_version()  # (loads NVRTC)
        for name in ("_ArgInfo", "_decide_params_type", "_get_elementwise_kernel_code"):
            getattr(_kernel, name)
        core.assemble_cupy_compiler_options, compiler._NVRTCProgram  # noqa: B018
    except Exception as exc:
        pytest.skip(f"CuPy's kernel generator or NVRTC is not usable here: {exc}")
    return cp, _carray, _kernel, _scalar, core, compiler


def _kernel_uses(cp):
    """Every ElementwiseKernel in sparsecoll as its call site uses it: (kernel, the
    parameters passed as numpy scalars, one dtype map per placeholder type it is called
    with; parameters of a fixed type and those of placeholder type are filled in)."""
    from sparsecoll import _array
    from sparsecoll.select import _cupy_kernels

    floats = [{"T": np.dtype(t)} for t in (np.float32, np.float64)]  # (float16: CuPy ufuncs)
    uses = [(_array._segment_sum_kernel.__wrapped__(cp), set(), floats)]
    for has_r in (False, True):
        for has_u in (False, True):
            kern = _cupy_kernels.accumulate_kernel.__wrapped__(cp, has_r, has_u)
            uses.append((kern, {"m", "cut"}, floats))
    uses.append((_cupy_kernels.widen_kernel.__wrapped__(cp), {"s", "c"}, floats[:1]))
    return uses


def _cupy_generated_source(kernel_mod, cp, kern, scalars, types, idx32):
    """The CUDA source CuPy generates for ``kern`` called with 1-D contiguous arrays of
    the given types (scalars where named), 32- or 64-bit indexing."""
    _carray, _kernel, _scalar = kernel_mod

    def dtype(p):
        return np.dtype(p.dtype) if p.dtype is not None else types[p.ctype]

    in_nd = tuple(None if p.name in scalars else dtype(p) for p in kern.in_params)
    out_nd = tuple(dtype(p) for p in kern.out_params)
    _, _, type_map = _kernel._decide_params_type(kern.in_params, kern.out_params, in_nd, out_nd)
    infos = [
        _kernel._ArgInfo(3, _scalar.CScalar, dtype(p), 0, True, True)  # 3: a scalar
        if p.name in scalars
        else _kernel._ArgInfo(1, cp.ndarray, dtype(p), 1, True, idx32)  # 1: an array
        for p in kern.in_params + kern.out_params
    ]
    infos.append(_kernel._ArgInfo(2, _carray.Indexer, None, 1, True, idx32))  # 2: indexer
    code = _kernel._get_elementwise_kernel_code(
        tuple(infos), type_map, kern.params, kern.operation, kern.name, kern.preamble
    )
    return "#include <cupy/carray.cuh>\n" + code


def test_kernels_compile_as_cupy_generates_them():
    """Compile every sparsecoll ElementwiseKernel as CuPy itself would on an H100: the real
    ``cupy.ElementwiseKernel``, CuPy's generated source (CArray parameters, CIndexer loop,
    its headers and options, the kernel's own options) for each dtype the call sites use,
    32- and 64-bit indexing, through NVRTC to sm_90 machine code. Needs CuPy and NVRTC,
    not a GPU (the arch is given, not queried)."""
    cp, _carray, _kernel, _scalar, core, compiler = _cupy_codegen()
    compiled = 0
    for kern, scalars, type_maps in _kernel_uses(cp):
        assert isinstance(kern, cp.ElementwiseKernel)
        opts = core.assemble_cupy_compiler_options(tuple(kern.kwargs.get("options", ())))
        opts += ("-arch=sm_90", "--device-as-default-execution-space")
        for types in type_maps:
            for idx32 in (True, False):
                mods = (_carray, _kernel, _scalar)
                code = _cupy_generated_source(mods, cp, kern, scalars, types, idx32)
                prog = compiler._NVRTCProgram(code, "kern.cu", (), (), method="cubin")
                try:
                    cubin, _ = prog.compile(opts)
                except Exception as exc:
                    pytest.fail(f"{kern.name} ({types}, 32-bit index {idx32}):\n{code}\n{exc}")
                assert len(cubin) > 1000
                compiled += 1
    assert compiled == 2 * (2 + 4 * 2 + 1)


def test_kernels_keep_float32_subnormals_under_cupys_ftz():
    """CuPy compiles every kernel with ``-ftz=true`` appended to its options
    (``cupy.cuda.compiler._compile_with_cache_cuda``), and float32 arithmetic then flushes
    subnormal operands and results to 0: the fused pass on a GPU turned g + r for a
    subnormal g into 0 (PTX ``add.rn.ftz.f32``), where the host keeps it (and
    test_accumulate_cut_zero_never_selects_zeros expects it). The sums and products of
    sparsecoll's kernels must compile to IEEE float32 instructions even so, and their
    widening to float64 keep subnormals (a cast compiles to ``cvt.ftz.f64.f32``)."""
    import re

    cp, _carray, _kernel, _scalar, core, compiler = _cupy_codegen()
    found = []
    for kern, scalars, _ in _kernel_uses(cp):
        opts = core.assemble_cupy_compiler_options(tuple(kern.kwargs.get("options", ())))
        opts += ("-arch=sm_90", "--device-as-default-execution-space", "-ftz=true")
        types = {"T": np.dtype(np.float32)}
        code = _cupy_generated_source((_carray, _kernel, _scalar), cp, kern, scalars, types, True)
        ptx, _ = compiler._NVRTCProgram(code, "kern.cu", (), (), method="ptx").compile(opts)
        ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
        arithmetic = re.findall(r"\b(?:add|sub|mul|fma|div|cvt\.[\w.]*f64)\.[\w.]*f32\b", ptx)
        flushing = sorted({op for op in arithmetic if ".ftz" in op})
        assert not flushing, f"{kern.name}: {flushing}"
        found += arithmetic
    # (the check reads the PTX it means to)
    assert {"add.rn.f32", "mul.rn.f32", "cvt.f64.f32"} <= set(found)


@given(x=vectors(), data=st.data())
def test_public_dispatch_matches_cpu_backend(xp, x, data):
    """``sparsecoll.select`` on device arrays equals the CPU backend on the same values."""
    select = pytest.importorskip("sparsecoll.select")
    if not hasattr(select, "topk"):
        pytest.skip("sparsecoll.select has no dispatch here")
    n = x.shape[0]
    d = xp.asarray(x)
    k = data.draw(st.integers(0, n))
    t = data.draw(st.sampled_from([0.0, 0.5, 1.0, 3.0]))
    with select.use_backend("numpy"):  # the CPU oracle, without Numba compile time
        hi, hv = select.topk(x, k)
        h_thr, h_cnt = select.threshold(x, t)[0], select.count_ge(x, t)
        h_kth = select.kth_largest_abs(x, max(k, 1)) if n else None
    di, dv = select.topk(d, k)
    assert isinstance(di, xp.ndarray)
    np.testing.assert_array_equal(di.get(), hi)
    np.testing.assert_array_equal(dv.get(), hv)
    np.testing.assert_array_equal(select.threshold(d, t)[0].get(), h_thr)
    assert select.count_ge(d, t) == h_cnt
    if n:
        assert select.kth_largest_abs(d, max(k, 1)) == h_kth


@given(x=vectors(), data=st.data())
def test_accumulate_matches_cpu_backend(xp, x, data):
    """The fused error-feedback pass on device arrays equals the numpy backend."""
    from sparsecoll import select

    n = x.shape[0]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    r = rng.standard_normal(n).astype(x.dtype)
    u = rng.standard_normal(n).astype(x.dtype)
    m = data.draw(st.sampled_from([0.0, 0.9]))
    lo = data.draw(st.integers(0, n))
    hi = data.draw(st.integers(lo, n))
    kw = {"cut": data.draw(st.sampled_from([0.0, 0.5, 3.0])), "lo": lo, "hi": hi, "momentum": m}
    runs = []
    for mod, conv in ((np, np.asarray), (xp, xp.asarray)):
        out, uo, zero = conv(np.empty(n, x.dtype)), conv(np.empty(n, x.dtype)), conv(x.copy())
        vel = (conv(u), uo) if m else (None, None)
        with select.use_backend("numpy"), np.errstate(over="ignore", invalid="ignore"):
            got = select.accumulate(
                conv(x), conv(r), out=out, velocity=vel[0], velocity_out=vel[1], zero=zero, **kw
            )
        to = (lambda a: a) if mod is np else (lambda a: a.get())
        runs.append((to(out), to(got.indices), to(got.values), got.hits, got.nonfinite, to(zero)))
    (ho, hi_, hv, hh, hb, hz), (do, di, dv, dh, db, dz) = runs
    np.testing.assert_array_equal(do, ho)
    assert not dz.any() and not hz.any()
    assert (dh, db) == (hh, hb)
    if not hb:
        np.testing.assert_array_equal(di, hi_)
        np.testing.assert_array_equal(dv, hv)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_accumulate_cut_zero_never_selects_zeros(xp, dtype):
    """cut=0 selects the nonzeros (the smallest subnormal stands in for it): exact zeros
    and -0.0 stay out, the smallest subnormal is in. On an H100 the compare once took the
    subnormal cut as zero."""
    from sparsecoll import select

    tiny = np.finfo(dtype).smallest_subnormal
    g = np.array([0.5, 0.0, -0.25, -0.0, tiny, 1.0, -tiny, 3.0], dtype=dtype)
    r = np.array([-0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -3.0], dtype=dtype)
    got = select.accumulate(xp.asarray(g), xp.asarray(r), out=xp.empty(8, dtype), cut=0.0)
    assert got.hits == 4
    np.testing.assert_array_equal(got.indices.get(), [2, 4, 5, 6])


def _bits_of(a: np.ndarray) -> np.ndarray:
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def test_float32_subnormals_on_the_device_as_on_the_host(xp):
    """CuPy compiles every kernel with -ftz=true, so its own ufuncs read float32 subnormals
    as zeros: ``abs(v) >= zero_cut`` with a subnormal cut, ``count_nonzero``, ``min``, the
    cast to float64 (PTX abs.ftz.f32, setp.ge.ftz.f32, cvt.ftz.f64.f32; the fake CuPy
    flushes there too). Vectors of subnormals came out wrong on the device: the fused pass
    zeroed entries below zero_cut and counted no nonzeros, moments were 0, the exact
    threshold 0, exdyna's window sent no magnitudes, and a reducer's step dropped every
    selected entry. Each now equals the host's result."""
    from mpi4py import MPI

    import sparsecoll
    from sparsecoll import select
    from sparsecoll.algorithms._exdyna_threshold import _top_magnitudes

    tiny = np.finfo(np.float32).smallest_subnormal
    rng = np.random.default_rng(3)
    x = (rng.integers(-40, 41, 300) * tiny).astype(np.float32)  # zeros of both signs too
    x[:2] = (-0.0, 0.0)
    runs = []
    for conv, get in ((np.asarray, np.asarray), (xp.asarray, lambda a: a.get())):
        out = conv(np.empty_like(x))
        with select.use_backend("numpy"):
            got = select.accumulate(
                conv(x), out=out, cut=0.0, zero_cut=float(20 * tiny), nonzeros=True
            )
            ex = select.ExactThreshold(k=30).select(conv(x))
            runs.append(
                (
                    _bits_of(get(out)), get(got.indices), _bits_of(get(got.values)),
                    got.hits, got.nonzeros, ex.threshold, get(_top_magnitudes(conv(x), 50)),
                )
            )  # fmt: skip
    for h, d in zip(*runs):
        np.testing.assert_array_equal(d, h)
    assert runs[0][4] == np.count_nonzero(x) and runs[0][5] > 0
    sv = SparseVector.from_dense(xp.asarray(x))  # (flatnonzero on CuPy: != 0, flushed)
    np.testing.assert_array_equal(sv.indices.get(), np.flatnonzero(x))
    with select.use_backend("numpy"):
        hm = select.moments(x)
    np.testing.assert_allclose(select.moments(xp.asarray(x)), hm, rtol=1e-12, atol=0)
    comm = sparsecoll.Communicator(MPI.COMM_SELF)
    want = sparsecoll.GradientReducer(comm, 300, "allgather", 0.1).step(x.copy())
    red = sparsecoll.GradientReducer(comm, 300, "allgather", 0.1)
    assert np.count_nonzero(want) == 30
    np.testing.assert_array_equal(_bits_of(red.step(xp.asarray(x)).get()), _bits_of(want))


def test_from_coo_on_another_device_than_the_current(xp):
    """SparseVector.from_coo checks, coalesces and returns inputs on GPU 1 on GPU 1 while GPU
    0 is current; indices on another GPU than the values are refused."""
    if xp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    with xp.cuda.Device(1):
        idx, vals = xp.asarray(np.array([5, 1, 5])), xp.asarray(np.array([1.0, 2.0, 3.0]))
    with xp.cuda.Device(0):
        x = SparseVector.from_coo(idx, vals, 8)
        with pytest.raises(TypeError, match="same device, got GPU 1 and GPU 0"):
            SparseVector.from_coo(xp.asarray(np.array([1, 5, 6])), vals, 8)
    assert x.values.device.id == 1 and x.indices.device.id == 1
    np.testing.assert_array_equal(x.indices.get(), [1, 5])
    np.testing.assert_array_equal(x.values.get(), [2.0, 4.0])


def test_reducer_works_on_the_gradients_device(xp):
    """A gradient on GPU 1 is reduced on GPU 1 whatever the current device: from the main
    thread with device 0 current, and from step_async's progress thread, which (as every
    new CUDA host thread) starts on device 0. CuPy refuses kernels on arrays of another
    GPU (or, with peer access, runs them from the current one, allocating there)."""
    from mpi4py import MPI

    import sparsecoll

    if xp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    n = 4000
    g = np.random.default_rng(7).standard_normal(n).astype(np.float32)
    comm = sparsecoll.Communicator(MPI.COMM_SELF)
    host = sparsecoll.GradientReducer(comm, n, "allgather", 0.01)
    want = [host.step(g.copy()) for _ in range(3)]
    with xp.cuda.Device(1):
        dg = xp.asarray(g)
    red = sparsecoll.GradientReducer(comm, n, "allgather", 0.01)
    with xp.cuda.Device(0):
        got = [red.step(dg), red.step_async(dg).wait(timeout=60)]
    with xp.cuda.Device(1):
        out = xp.zeros_like(dg)
    with xp.cuda.Device(0):
        got.append(red.step_async(dg, out=out).wait(timeout=60))
    for a, w in zip(got, want):
        assert a.device.id == 1
        np.testing.assert_array_equal(a.get(), w)


def test_reducer_state_follows_the_gradient_to_another_device(xp):
    """A gradient that moves to another GPU between steps (a model moved with ``.to()``)
    meets its residual, velocity and reused update there, and an ``out`` on another GPU
    than the gradient is refused by name."""
    from mpi4py import MPI

    import sparsecoll

    if xp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    n = 4000
    g = np.random.default_rng(8).standard_normal(n).astype(np.float32)
    comm = sparsecoll.Communicator(MPI.COMM_SELF)
    opts = dict(momentum=0.9, reuse_update=True)
    host = sparsecoll.GradientReducer(comm, n, "allgather", 0.01, **opts)
    want = [host.step(g.copy()).copy() for _ in range(4)]
    red = sparsecoll.GradientReducer(comm, n, "allgather", 0.01, **opts)
    got = []
    for dev in (0, 0, 1, 1):
        with xp.cuda.Device(dev):
            a = red.step(xp.asarray(g))
            assert a.device.id == dev
            got.append(a.get())
    for a, w in zip(got, want):
        np.testing.assert_array_equal(a, w)
    with xp.cuda.Device(0):
        out = xp.zeros(n, np.float32)
    with xp.cuda.Device(1):
        dg = xp.asarray(g)
        with pytest.raises(
            sparsecoll.CollectiveTypeError, match="same device as grad, got it on GPU 0"
        ):
            red.step(dg, out=out)


@pytest.mark.parametrize(("algorithm", "key"), [("oktopk", "boundaries"), ("exdyna", "bounds")])
def test_algorithm_state_with_device_arrays_loads(xp, algorithm, key):
    """A state whose algorithm's bounds were put on a GPU loads: they come to the host, as
    state_dict() saves them, and the run goes on bit for bit. Before, they were restored on
    the device and the next step raised (numpy cannot read a CuPy array implicitly)."""
    from mpi4py import MPI

    import sparsecoll

    n = 3000
    g = [np.random.default_rng([7, t]).standard_normal(n).astype(np.float32) for t in range(5)]
    comm = sparsecoll.Communicator(MPI.COMM_SELF)
    red = sparsecoll.GradientReducer(comm, n, algorithm, 0.01)
    for t in range(2):
        red.step(g[t])
    state = red.state_dict()
    state["algorithm_state"][key] = xp.asarray(state["algorithm_state"][key])
    other = sparsecoll.GradientReducer(comm, n, algorithm, 0.01)
    other.load_state_dict(state)
    for t in range(2, 5):
        np.testing.assert_array_equal(other.step(g[t]), red.step(g[t]))


def test_reducer_state_with_device_arrays_loads(xp):
    """A state whose residual and velocity were put on a GPU loads into a reducer (they
    come to the host, as
    state_dict() saves them) and the run goes on bit for bit, on the host or the device.
    Before, numpy's implicit conversion of a CuPy array raised a TypeError, after the step
    counter had already been replaced."""
    from mpi4py import MPI

    import sparsecoll

    n = 3000
    g = [np.random.default_rng([9, t]).standard_normal(n).astype(np.float32) for t in range(5)]
    comm = sparsecoll.Communicator(MPI.COMM_SELF)
    red = sparsecoll.GradientReducer(comm, n, "allgather", 0.01, momentum=0.5)
    for t in range(2):
        red.step(g[t])
    state = red.state_dict()
    for key in ("residual", "velocity"):
        state[key] = xp.asarray(state[key])
    on_host = sparsecoll.GradientReducer(comm, n, "allgather", 0.01, momentum=0.5)
    on_device = sparsecoll.GradientReducer(comm, n, "allgather", 0.01, momentum=0.5)
    on_host.load_state_dict(state)
    on_device.load_state_dict(state)
    for t in range(2, 5):
        want = red.step(g[t])
        np.testing.assert_array_equal(on_host.step(g[t]), want)
        np.testing.assert_array_equal(on_device.step(xp.asarray(g[t])).get(), want)


@pytest.mark.skipif(
    os.environ.get("SPARSECOLL_CPU_KERNELS") != "1",
    reason="set SPARSECOLL_CPU_KERNELS=1 (a minute or more: a CPU thread per CUDA thread)",
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_selection_kernels_run_on_cpu_threads(monkeypatch, dtype):
    """The selection module's CUDA C itself (not the fake's numpy re-statements), compiled
    with g++ and run a std::thread per CUDA thread (tests/cudaemu.py), under the host code
    of select._cupy: top-k by both paths, every digit, threshold, counts and the mask
    compaction, on lengths around the tile and warp edges. Warp intrinsics abort when a
    lane of their mask does not take part or a shuffle reads a lane outside it."""
    from . import cudaemu

    if not cudaemu.available():
        pytest.skip("no g++")
    from sparsecoll.select import _cupy, _cupy_kernels

    rng = np.random.default_rng([7, np.dtype(dtype).itemsize])
    with fakecupy.installed() as fake:
        monkeypatch.setattr(fake, "RawModule", cudaemu.RawModule)
        _cupy_kernels.module.cache_clear()
        try:
            for n in (33, 4097, 9000):
                for kind in ("normal", "ties", "sub"):
                    if kind == "ties":
                        x = rng.integers(-3, 4, n).astype(dtype)
                    elif kind == "sub":
                        x = rng.integers(-5, 6, n) * np.finfo(dtype).smallest_subnormal
                        x = x.astype(dtype)
                    else:
                        x = rng.standard_normal(n).astype(dtype)
                    x[rng.integers(0, n)] = -np.inf
                    absx = np.abs(x.astype(np.float64))
                    d = fake.asarray(x)
                    for k, cap in ((1, 1 << 21), (n // 3 + 1, 1 << 21), (n - 1, 0)):
                        monkeypatch.setattr(_cupy, "_CANDIDATES", cap)
                        want = reference_topk(x, k)
                        idx, vals = _cupy.topk(d, k)
                        np.testing.assert_array_equal(idx.get(), want)
                        np.testing.assert_array_equal(vals.get(), x[want])
                        assert _cupy.kth_largest_abs(d, k) == np.sort(absx)[::-1][k - 1]
                    t = float(absx[rng.integers(0, n)])
                    np.testing.assert_array_equal(
                        _cupy.threshold(d, t)[0].get(), np.flatnonzero(absx >= t)
                    )
                    assert _cupy.count_ge(d, t) == int(np.count_nonzero(absx >= t))
                mask = rng.random(n) < 0.3
                got = _cupy.flatnonzero_mask(fake.asarray(mask)[n // 3 :])
                np.testing.assert_array_equal(got.get(), np.flatnonzero(mask[n // 3 :]))
        finally:
            _cupy_kernels.module.cache_clear()
