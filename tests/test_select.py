"""Selection (sparsecoll.select) against sort-based oracles, on every backend and code path.

Backends: "numba" (the kernels with their real tunables), "numba-small" (tunables shrunk so
that small arrays take the chunked, sampled-candidate paths), "numpy" (the fallback), and
"cupy" when a GPU is present (the same oracles, through the lazy GPU backend).
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator

import numba
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from sparsecoll import SparseVector
from sparsecoll import select as sel
from sparsecoll._array import cupy_or_none, index_dtype
from sparsecoll.select import _common, _numba, _numba_core, _numba_select, _numba_train, _numpy

DTYPES = (np.float16, np.float32, np.float64)
BACKENDS = [
    "numba",
    "numba-small",
    "numpy",
    pytest.param("cupy", marks=pytest.mark.gpu),
]


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Select a backend; "numba-small" shrinks the kernels' tunables (so every chunked
    path runs on small arrays, the parallel kernels on 2 threads where Numba has them)."""
    if name == "cupy" and cupy_or_none() is None:
        pytest.skip("no GPU")
    if name != "numba-small":
        with sel.use_backend("numpy" if name == "numpy" else "numba"):
            yield
        return
    small = {
        (_numba_core, "MIN_CHUNK"): 5,
        (_numba_select, "PREFILTER_MIN_N"): 12,
        (_numba_select, "SAMPLE_SIZE"): 8,
        (_numba_core, "PARALLEL_MIN"): 40,
        (_numba_core, "_threads"): min(2, numba.config.NUMBA_NUM_THREADS),
    }
    saved = {(mod, a): getattr(mod, a) for mod, a in small}
    for (mod, a), v in small.items():
        setattr(mod, a, v)
    try:
        with sel.use_backend("numba"):
            yield
    finally:
        for (mod, a), v in saved.items():
            setattr(mod, a, v)


def dev(x: np.ndarray, name: str):
    """x on the backend's device."""
    return cupy_or_none().asarray(x) if name == "cupy" else x


def host(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()


# -- oracles ------------------------------------------------------------------------------


def topk_oracle(x: np.ndarray, k: int) -> np.ndarray:
    """Sorted indices of the k largest |x|, ties to the lower index (a full sort)."""
    a = np.abs(x.astype(np.float64))
    order = np.lexsort((np.arange(x.shape[0]), -a))
    return np.sort(order[:k])


def threshold_oracle(x: np.ndarray, t: float) -> np.ndarray:
    return np.flatnonzero(np.abs(x.astype(np.float64)) >= t)


# -- inputs -------------------------------------------------------------------------------

SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.5, -2.0, 3.0, np.inf, -np.inf, 1e-7, -65504.0]


@st.composite
def vectors(draw, max_size: int = 300) -> np.ndarray:
    """float16/32/64 vectors: arbitrary floats, heavy ties (incl. zeros, +-0, inf), or
    Gaussian with a random scale. Never NaN."""
    dt = np.dtype(draw(st.sampled_from(DTYPES)))
    n = draw(st.integers(0, max_size))
    kind = draw(st.sampled_from(["any", "ties", "normal", "constant"]))
    if kind == "any":
        elems = st.floats(width=8 * dt.itemsize, allow_nan=False)
        return draw(arrays(dt, n, elements=elems))
    if kind == "ties":  # (each value as dt holds it: numpy 1.x compares 1e-7 != float32(1e-7),
        # and Hypothesis refused the element as changed by the array)
        return draw(arrays(dt, n, elements=st.sampled_from(np.array(SPECIAL, dt).tolist())))
    if kind == "constant":
        return np.full(n, draw(st.sampled_from(SPECIAL)), dtype=dt)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return (rng.standard_normal(n) * 10.0 ** draw(st.integers(-3, 3))).astype(dt)


@st.composite
def vector_and_k(draw) -> tuple[np.ndarray, int]:
    x = draw(vectors())
    return x, draw(st.integers(0, x.shape[0]))


@st.composite
def vector_and_t(draw) -> tuple[np.ndarray, float]:
    x = draw(vectors())
    if x.shape[0] and draw(st.booleans()):
        t = float(abs(x[draw(st.integers(0, x.shape[0] - 1))]))  # a value of x: ties at t
    else:
        t = draw(st.floats(allow_nan=False, min_value=-1e300, max_value=np.inf))
    return x, t


# -- exact selection ----------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
@given(case=vector_and_k())
def test_topk_matches_sort_oracle(name: str, case: tuple[np.ndarray, int]) -> None:
    x, k = case
    with backend(name):
        idx, vals = sel.topk(dev(x, name), k)
    idx, vals = host(idx), host(vals)
    expect = topk_oracle(x, k)
    assert idx.dtype == index_dtype(x.shape[0])
    assert vals.dtype == x.dtype
    np.testing.assert_array_equal(idx, expect)
    np.testing.assert_array_equal(vals.view(np.uint8), x[expect].view(np.uint8))  # bits, -0.0


@pytest.mark.parametrize("name", BACKENDS)
@given(case=vector_and_t())
def test_threshold_matches_flatnonzero(name: str, case: tuple[np.ndarray, float]) -> None:
    x, t = case
    with backend(name):
        idx, vals = sel.threshold(dev(x, name), t)
        count = sel.count_ge(dev(x, name), t)
    idx, vals = host(idx), host(vals)
    expect = threshold_oracle(x, t)
    assert idx.dtype == index_dtype(x.shape[0])
    np.testing.assert_array_equal(idx, expect)
    np.testing.assert_array_equal(vals.view(np.uint8), x[expect].view(np.uint8))
    assert count == expect.shape[0]
    with np.errstate(over="ignore"):
        representable = float(x.dtype.type(t)) == t
    if representable:  # the plain numpy expression agrees
        np.testing.assert_array_equal(idx, np.flatnonzero(np.abs(x) >= x.dtype.type(t)))


@pytest.mark.parametrize("name", BACKENDS)
@given(case=vector_and_k())
def test_kth_largest_abs(name: str, case: tuple[np.ndarray, int]) -> None:
    x, k = case
    assume(k >= 1)
    with backend(name):
        t = sel.kth_largest_abs(dev(x, name), k)
    assert t == np.sort(np.abs(x.astype(np.float64)))[::-1][k - 1]
    assert isinstance(t, float)


@given(case=vector_and_k(), t=st.floats(allow_nan=False))
def test_backends_identical(case: tuple[np.ndarray, int], t: float) -> None:
    """The Numba kernels (both tunings) and the numpy fallback give the same bits."""
    x, k = case
    out = {}
    for name in ("numba", "numba-small", "numpy"):
        with backend(name):
            out[name] = (sel.topk(x, k), sel.threshold(x, t), sel.count_ge(x, t))
    ref = out.pop("numpy")
    for got in out.values():
        for (gi, gv), (ri, rv) in zip(got[:2], ref[:2]):
            assert gi.dtype == ri.dtype
            np.testing.assert_array_equal(gi, ri)
            np.testing.assert_array_equal(gv.view(np.uint8), rv.view(np.uint8))
        assert got[2] == ref[2]


@pytest.mark.parametrize("name", ["numba", "numpy"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("density", [1e-4, 1e-3, 0.01, 0.3])
def test_topk_large_gaussian(name: str, dtype: type, density: float) -> None:
    """Sizes where the sampled-candidate path runs with the real tunables."""
    n = 300_007
    x = np.random.default_rng(7).standard_normal(n).astype(dtype)
    k = round(density * n)
    with backend(name):
        idx, vals = sel.topk(x, k)
        kth = sel.kth_largest_abs(x, k)
    expect = topk_oracle(x, k)
    np.testing.assert_array_equal(idx, expect)
    np.testing.assert_array_equal(vals, x[expect])
    assert kth == float(np.abs(x[expect]).min())


@pytest.mark.parametrize("name", ["numba", "numba-small", "numpy"])
def test_topk_sample_misled(name: str) -> None:
    """Inputs that defeat the strided sample (sorted, periodic, mostly zero, all equal):
    the fallback keeps the result exact."""
    n = 200_000
    rng = np.random.default_rng(3)
    periodic = np.zeros(n, np.float32)
    periodic[:: n // _numba_select.SAMPLE_SIZE] = 1.0  # the sample sees only these
    sparse = np.zeros(n, np.float32)
    sparse[rng.integers(0, n, 50)] = rng.standard_normal(50)
    cases = [
        np.sort(rng.standard_normal(n)).astype(np.float32),
        periodic,
        sparse,
        np.full(n, 2.5, np.float32),
        -np.abs(rng.standard_normal(n)).astype(np.float32),
    ]
    with backend(name):
        for x in cases:
            for k in (1, 100, 5_000, n - 1):
                idx, _ = sel.topk(x, k)
                np.testing.assert_array_equal(idx, topk_oracle(x, k))


def test_int64_index_path() -> None:
    """The kernels write int64 indices (as they do for n > 2**31) with the same results.
    (float32 only: each dtype costs seconds of compiling, and the code is dtype-generic.)"""
    x = np.random.default_rng(1).standard_normal(100_000).astype(np.float32)
    for fn, arg in ((_numba.topk, 777), (_numba.threshold, 2.0)):
        i32, v32 = fn(x, arg)
        i64, v64 = fn(x, arg, np.int64)
        assert i32.dtype == np.int32
        assert i64.dtype == np.int64
        np.testing.assert_array_equal(i32, i64)
        np.testing.assert_array_equal(v32, v64)


@given(x=vectors(max_size=3000), frac=st.sampled_from([0.0, 0.001, 0.1, 1.0]), t=st.floats(0, 3))
def test_scatter_room_estimates(x: np.ndarray, frac: float, t: float) -> None:
    """However wrong the estimated hit fraction (0 forces the overflow rerun, 1 never
    overflows), the one-pass scatter returns exactly the hits, with or without a limit."""
    saved = _numba_core.MIN_CHUNK
    _numba_core.MIN_CHUNK = 64
    try:
        b, info = _numba_core._keys(x)
        lo = _common.threshold_key(t, x.dtype)
        idx, bits = _numba_select._gather_keys(b, info, lo, np.int32, frac)
        limited = _numba_select._gather_keys(b, info, lo, np.int32, frac, limit=5)
    finally:
        _numba_core.MIN_CHUNK = saved
    expect = threshold_oracle(x, _common.round_threshold(t, x.dtype))
    np.testing.assert_array_equal(idx, expect)
    np.testing.assert_array_equal(bits, x[expect].view(info.utype))
    if limited is None:
        assert expect.shape[0] > 5
    else:
        np.testing.assert_array_equal(limited[0], expect)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SPARSECOLL_BIG") != "1", reason="set SPARSECOLL_BIG=1 (4 GiB)")
def test_beyond_int32() -> None:
    """n > 2**31 (float16, 4 GiB): int64 indices, entries past 2**31 found."""
    n = 2**31 + 1000
    x = np.zeros(n, np.float16)
    x[[5, 2**31 - 1, 2**31, n - 1]] = [1.0, -4.0, 3.0, -2.0]
    idx, vals = sel.topk(x, 3)
    assert idx.dtype == np.int64
    assert idx.tolist() == [2**31 - 1, 2**31, n - 1]
    assert vals.tolist() == [-4.0, 3.0, -2.0]
    idx, _ = sel.threshold(x, 1.0)
    assert idx.tolist() == [5, 2**31 - 1, 2**31, n - 1]
    assert sel.count_ge(x, 2.5) == 2
    assert sel.kth_largest_abs(x, 4) == 1.0


# -- NaN, inf, bad input ------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
@given(x=vectors(), data=st.data())
def test_nan_raises(name: str, x: np.ndarray, data: st.DataObject) -> None:
    assume(x.shape[0] > 0)
    x = x.copy()
    x[data.draw(st.integers(0, x.shape[0] - 1))] = np.nan
    n = x.shape[0]
    k = data.draw(st.integers(0, n))
    with backend(name):
        d = dev(x, name)
        for call in (
            lambda: sel.topk(d, k),
            lambda: sel.threshold(d, 1.0),
            lambda: sel.threshold(d, np.inf),
            lambda: sel.count_ge(d, 0.0),
            lambda: sel.kth_largest_abs(d, max(k, 1)),
            lambda: sel.moments(d),  # (before: (nan, nan) on the CPU backends)
        ):
            with pytest.raises(ValueError, match="NaN"):
                call()


@pytest.mark.parametrize("name", ["numba", "numba-small", "numpy"])
def test_nan_raises_large(name: str) -> None:
    """NaN found on every path of a large array: one NaN anywhere, or a negative one."""
    x = np.random.default_rng(2).standard_normal(150_000).astype(np.float32)
    with backend(name):
        for pos, nan in ((0, np.nan), (77_777, -np.nan), (149_999, np.nan)):
            y = x.copy()
            y[pos] = nan
            for k in (0, 1, 100, 150_000):
                with pytest.raises(ValueError, match="NaN"):
                    sel.topk(y, k)


def test_inf_is_largest() -> None:
    x = np.array([1.0, -np.inf, 3.0, np.inf, -2.0], np.float32)
    idx, _vals = sel.topk(x, 2)
    assert idx.tolist() == [1, 3]
    assert sel.threshold(x, np.inf)[0].tolist() == [1, 3]
    assert sel.kth_largest_abs(x, 1) == np.inf


def test_threshold_compares_exactly() -> None:
    """A float64 threshold between two float16 values is not rounded to the nearer one."""
    x = np.array([0.1, 0.2], np.float16)
    t = float(x[0]) + 1e-6  # rounds back to float16(0.1) when cast to float16
    assert np.float16(t) == x[0]
    assert sel.threshold(x, t)[0].tolist() == [1]
    assert sel.count_ge(x, float(x[0])) == 2
    assert _common.round_threshold(1e6, np.float16) == np.inf
    assert _common.round_threshold(-3.0, np.float16) == 0.0


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.filterwarnings("error")
def test_threshold_above_the_largest_finite_value(name: str) -> None:
    """A finite t above the dtype's largest finite value (65505 in float16, which rounds
    down to 65504) selects only the infinities, and warns of no overflow (it did: the
    step up from 65504 to inf in round_threshold ran outside the errstate)."""
    x = np.array([1.0, 65504.0, -np.inf, -65504.0, np.inf], np.float16)
    with backend(name):
        assert sel.threshold(x, 65505.0)[0].tolist() == [2, 4]
        assert sel.count_ge(x, 65505.0) == 2
        assert sel.count_ge(x, 65504.0) == 4


@pytest.mark.parametrize("name", BACKENDS)
def test_threshold_given_as_an_integer_or_long_double_is_exact(name: str) -> None:
    """t that float64 cannot hold is compared exactly too: 2**53 + 1 (a Python or numpy
    integer) rounded to 2**53 and selected 2**53; a long double just above 1 selected 1;
    an integer beyond float64's range raised OverflowError (it selects the infinities)."""
    x = np.array([2.0**53, 1.0, -np.inf, 2.0**53 + 2], np.float64)
    with backend(name):
        for t in (2**53 + 1, np.int64(2**53 + 1), np.uint64(2**53 + 1)):
            assert sel.threshold(x, t)[0].tolist() == [2, 3], t
            assert sel.count_ge(x, t) == 2
            found = sel.accumulate(x, out=np.empty_like(x), cut=t, zero_cut=t)
            assert found.indices.tolist() == [2, 3]
        assert sel.count_ge(x, 2**53) == 3
        assert sel.threshold(x, 10**400)[0].tolist() == [2]
        assert sel.threshold(x, -(10**400))[0].tolist() == [0, 1, 2, 3]
        if np.finfo(np.longdouble).nmant > 52:  # (where long double is wider than float64)
            t = np.longdouble(1) + np.longdouble(2.0**-60)
            assert sel.threshold(x, t)[0].tolist() == [0, 2, 3]
            assert sel.count_ge(x, np.longdouble(1)) == 4


def test_bad_input() -> None:
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="k must be in"):
        sel.topk(x, 5)
    with pytest.raises(ValueError, match="k must be in"):
        sel.topk(x, -1)
    with pytest.raises(ValueError, match=r"k must be in \[1, 4\]"):
        sel.kth_largest_abs(x, 0)
    with pytest.raises(TypeError, match="k must be an integer"):
        sel.topk(x, 2.0)
    with pytest.raises(TypeError, match="float16, float32 or float64"):
        sel.topk(np.ones(4, np.int32), 2)
    with pytest.raises(ValueError, match="1-D"):
        sel.threshold(np.ones((2, 2), np.float32), 1.0)
    with pytest.raises(ValueError, match="t must not be NaN"):
        sel.threshold(x, float("nan"))
    with pytest.raises(ValueError, match="backend"):
        sel.set_backend("fortran")


def test_non_contiguous_and_lists() -> None:
    x = np.arange(20, dtype=np.float64)[::-2]  # strided view
    idx, vals = sel.topk(x, 3)
    assert idx.tolist() == [0, 1, 2]
    assert vals.tolist() == [19.0, 17.0, 15.0]
    idx, _ = sel.threshold([0.5, -3.0, 2.0], 2.0)
    assert idx.tolist() == [1, 2]


def test_sparse_helpers() -> None:
    v = SparseVector.from_coo(np.array([3, 10, 40, 41]), np.array([1.0, -5.0, 2.0, 5.0]), 50)
    top = sel.topk_sparse(v, 2)
    assert top.indices.tolist() == [10, 41]
    assert top.values.tolist() == [-5.0, 5.0]
    assert top.indices.dtype == np.int32
    assert top.n == 50
    thr = sel.threshold_sparse(v, 2.0)
    assert thr.indices.tolist() == [10, 40, 41]
    # (an array raised AttributeError "'numpy.ndarray' object has no attribute 'values'")
    with pytest.raises(TypeError, match=r"v must be a SparseVector, got ndarray .*topk\(x"):
        sel.topk_sparse(v.values, 2)
    with pytest.raises(TypeError, match=r"got list .*threshold\(x"):
        sel.threshold_sparse([1.0, 2.0], 2.0)


def test_env_disables_numba(tmp_path) -> None:
    """SPARSECOLL_NO_NUMBA=1 selects the numpy backend in a fresh interpreter."""
    import subprocess
    import sys

    code = "from sparsecoll import select; print(select.backend())"
    env = dict(os.environ, SPARSECOLL_NO_NUMBA="1")
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.strip() == "numpy"


def test_kernels_run_where_numba_cannot_write_a_cache() -> None:
    """An installed sparsecoll with site-packages and HOME read-only (Numba's two cache
    places): every kernel is decorated and runs uncached, with one warning naming
    NUMBA_CACHE_DIR (``njit(cache=True)`` raised "no locator available" at import of the
    kernel modules, so every selection, merge and training step failed)."""
    code = (
        "import errno, warnings\n"
        "from numba.core import caching\n"
        "def read_only(self):\n"
        "    raise OSError(errno.EROFS, 'Read-only file system', self.get_cache_path())\n"
        "caching._CacheLocator.ensure_cache_path = read_only\n"
        "import numpy as np\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    from sparsecoll import _array\n"
        "    from sparsecoll.algorithms import _merge\n"
        "    from sparsecoll.select import _numba, _numba_train\n"
        "    kernels = [getattr(_merge, f) for f in dir(_merge) if f.endswith('_kernel')]\n"
        "    [kernel() for kernel in [*kernels, _array._radix_argsort_kernel]]\n"
        "    idx = _merge.merge_two(np.array([1, 4]), np.array([1.0, 2.0]),\n"
        "                           np.array([4, 6]), np.array([3.0, 5.0]), 10)\n"
        "    top = _numba.topk(np.arange(-50.0, 50.0), 3)\n"
        "print(len(seen), 'NUMBA_CACHE_DIR' in str(seen[0].message) if seen else None)\n"
        "print(idx[0].tolist(), idx[1].tolist(), sorted(top[0].tolist()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["1 True", "[1, 4, 6] [1.0, 5.0, 5.0] [0, 1, 99]"]


def test_moments() -> None:
    x = np.random.default_rng(4).standard_normal(100_000).astype(np.float32) * 3 + 1
    for name in ("numba", "numpy"):
        with backend(name):
            mean, std = sel.moments(x)
        assert math.isclose(mean, float(x.astype(np.float64).mean()), rel_tol=1e-9, abs_tol=1e-9)
        assert math.isclose(std, float(x.astype(np.float64).std()), rel_tol=1e-9)
    assert sel.moments(np.ones(8, np.float16)) == (1.0, 0.0)


# the exponents that keep |x| < 4 (multiples of 2**-8) exact and finite in each dtype
SHIFTS = {np.float16: (-6, 13), np.float32: (-118, 125), np.float64: (-1014, 1021)}


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(200, 3000), at=st.floats(0.0, 1.0))
def test_moments_anywhere_in_the_float_range(name, dtype, seed, n, at) -> None:
    """moments(x·2**s) = moments(x)·2**s, to rounding, for every s that keeps x exact and
    finite in its dtype: float64 squares pass float64's range from |x| ~ 1.3e154 on, and
    lose bits below ~1.5e-154 (before: NaN or inf from 1e154, 0 at 1e-170). So Gaussian-k
    fits x, not the exact fallback (before: it fell back, or raised an OverflowError
    fitting the tail), and no warning comes from the numpy path."""
    lo, hi = SHIFTS[dtype]
    shift = lo + round(at * (hi - lo))
    g = np.random.default_rng(seed).standard_normal(n) * 0.7 + 0.2
    base = np.clip(np.round(g * 256) / 256, -3.99, 3.99)
    x0, x = base.astype(dtype), np.ldexp(base, shift).astype(dtype)
    with backend(name), warnings.catch_warnings():
        warnings.simplefilter("error")
        (m0, s0), (m, s) = sel.moments(x0), sel.moments(x)
        est = sel.GaussianThreshold(density=0.02)
        want, got = est.select(x0), est.select(x)
    unit = math.ldexp(1.0, shift)
    assert math.isclose(m / unit, m0, rel_tol=1e-12, abs_tol=1e-12 * s0), (m, m0, shift)
    assert math.isclose(s / unit, s0, rel_tol=1e-12), (s, s0, shift)
    # (the tail search's later steps are scale-free only to rounding, which can move a
    # count by one and the path with it: the band is the contract, as on x itself)
    for chosen in (want, got):
        assert chosen.method in ("gaussian", "gaussian-topk"), (chosen.method, shift)
        assert est.lo * chosen.k <= chosen.count <= est.hi * chosen.k, (chosen, shift)


def two_pass(x: np.ndarray) -> tuple[float, float]:
    """The oracle: mean, then the mean square of x - mean, in long double."""
    v = x.astype(np.longdouble)
    mean = v.mean()
    return float(mean), float(np.sqrt(np.mean((v - mean) ** 2)))


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(2, 3000),
    offset=st.floats(1.0, 12.0),
    sign=st.sampled_from([1.0, -1.0]),
    outlier=st.booleans(),
)
def test_moments_of_data_with_a_large_offset(name, dtype, seed, n, offset, sign, outlier) -> None:
    """std where |mean| >> std (a common offset 10**1 to 10**12 std, |x| all near one
    magnitude, one outlier or none) as the two-pass std in long double: the sums are of
    x minus a shift near the mean, not E[x²] - mean², which cancelled (before: std 0 for
    float32 x around 1e8 with std 0.06, 2.4 for float64 around 1e8 with std 1), and
    Gaussian-k then fell back to the exact top-k on such data."""
    rng = np.random.default_rng(seed)
    top = {np.float16: 3.0, np.float32: 6.0, np.float64: 14.0}[dtype]  # offsets x can hold
    x = (sign * 10.0 ** min(offset, top) + rng.standard_normal(n)).astype(dtype)
    if outlier:
        x[rng.integers(n)] *= 1e3 if dtype != np.float16 else 30.0
    assume(np.ptp(x) > 0)
    want_mean, want_std = two_pass(x)
    with backend(name):
        mean, std = sel.moments(dev(x, name))
    assert math.isclose(mean, want_mean, rel_tol=1e-13, abs_tol=1e-9 * want_std), (mean, want_mean)
    assert math.isclose(std, want_std, rel_tol=1e-9), (std, want_std)


F64_MAX, F64_TINY = float(np.finfo(np.float64).max), float(np.finfo(np.float64).smallest_subnormal)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(
    "values",
    [
        [F64_MAX, -F64_MAX],  # std = the largest float: not inf (rounded up at the top)
        [F64_TINY, 0.0, 2 * F64_TINY],  # d = x - shift cancel in the sum, d² vanish
        [F64_TINY, 0.0, -F64_TINY],  # (so do the values themselves, unshifted)
        [3 * F64_TINY, -F64_TINY, 0.0, 0.0],
        [0.0],
        [-F64_MAX, F64_MAX / 2, F64_MAX],
    ],
)
@pytest.mark.parametrize("repeat", [1, 40])
def test_moments_at_the_ends_of_float64(name, values, repeat) -> None:
    """The two-pass std (long double) at float64's ends: the largest values of both signs,
    subnormals whose squares vanish and whose sum cancels. Before: std inf for ±max (after
    the shift; finite before it) and 0 for 0, ±5e-324 (sums 0 and 0 taken for all zeros)."""
    x = np.array(values * repeat, dtype=np.float64)
    want_mean, want_std = two_pass(x)
    with backend(name):
        mean, std = sel.moments(dev(x, name))
    spread = 1e-14 * float(np.abs(x).max()) + 2 * F64_TINY  # (the mean's rounding)
    assert math.isclose(mean, want_mean, rel_tol=1e-12, abs_tol=spread), (mean, want_mean)
    assert math.isclose(std, want_std, rel_tol=1e-12, abs_tol=F64_TINY), (std, want_std)
    assert (std > 0.0) == (want_std > 0.0), (std, want_std)  # (a subnormal std is not 0)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_gaussian_threshold_fits_data_with_a_large_offset(name, sign) -> None:
    """Gaussian-k on a float64 gradient with a common offset of 1e8 std fits it (before:
    std 0 or 2.4, so the exact fallback, "gaussian-exact")."""
    x = sign * 1e8 + np.random.default_rng(7).standard_normal(200_000)
    est = sel.GaussianThreshold(density=0.01)
    with backend(name):
        s = est.select(dev(x, name))
    assert s.method == "gaussian", s
    assert est.lo * s.k <= s.count <= est.hi * s.k, s


def test_backend_module_contract() -> None:
    """Every CPU backend provides the functions the dispatch (and the GPU module) names."""
    for mod in (_numba, _numpy):
        for fn in sel.BACKEND_FUNCTIONS:
            assert callable(getattr(mod, fn)), (mod.__name__, fn)


# -- estimators ---------------------------------------------------------------------------


def gradient_like(kind: str, n: int, seed: int, layout: int | None = None) -> np.ndarray:
    """Synthetic gradients: Gaussian, heavy-tailed (Student t, 3 dof), Laplace, or layers
    of different scales (Gaussian blocks spanning 3 decades, their cuts and scales drawn
    from ``layout``, default ``seed``)."""
    rng = np.random.default_rng(seed)
    if kind == "gaussian":
        x = rng.standard_normal(n)
    elif kind == "student":
        x = rng.standard_t(3, n)
    elif kind == "laplace":
        x = rng.laplace(size=n)
    else:
        x = rng.standard_normal(n)
        lay = np.random.default_rng(seed if layout is None else layout)
        cuts = np.sort(lay.integers(0, n, 7))
        for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, n]):
            x[lo:hi] *= 10.0 ** lay.uniform(-3, 0)
    return (x * 1e-3).astype(np.float32)


KINDS = ["gaussian", "student", "laplace", "layers"]


def check_selection(s: sel.Selection, x: np.ndarray) -> None:
    assert s.n == x.shape[0]
    assert np.all(np.diff(s.indices) > 0)
    np.testing.assert_array_equal(s.values, x[s.indices])
    if s.count:
        assert float(np.abs(s.values).min()) >= s.threshold or s.method.endswith("topk")


@given(
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**32 - 1),
    density=st.sampled_from([0.001, 0.01, 0.05]),
)
def test_estimators_within_band(kind: str, seed: int, density: float) -> None:
    x = gradient_like(kind, 100_000, seed)
    k = round(density * x.shape[0])
    for est in (
        sel.ExactThreshold(density=density),
        sel.SamplingThreshold(density=density, seed=seed),
        sel.GaussianThreshold(density=density),
    ):
        s = est.select(x)
        check_selection(s, x)
        assert s.k == k
        lo, hi = est.band
        assert lo * k <= s.count <= hi * k, (type(est).__name__, s)
        if isinstance(est, sel.ExactThreshold):
            np.testing.assert_array_equal(s.indices, topk_oracle(x, k))


@given(kind=st.sampled_from(KINDS), seed=st.integers(0, 2**32 - 1))
def test_reuse_threshold_holds_band(kind: str, seed: int) -> None:
    """Slowly drifting gradients (AR(1), correlation 0.995 per step): exact every 8 steps,
    the reused threshold keeps the count in the band on every step."""
    n, k = 50_000, 500
    rng = np.random.default_rng(seed)
    x = gradient_like(kind, n, seed)
    est = sel.ReuseThreshold(k, interval=8, nudge=1.02)
    for step in range(24):
        s = est.select(x)
        check_selection(s, x)
        assert s.method == ("reuse-exact" if step % 8 == 0 else "reuse")
        assert est.band[0] * k <= s.count <= est.band[1] * k, (step, s)
        noise = gradient_like(kind, n, int(rng.integers(2**32)), layout=seed)
        x = (0.995 * x + 0.1 * noise).astype(x.dtype)
    assert est.recomputes == 3


@pytest.mark.parametrize("scale", [1.15, 1 / 1.15])
def test_reuse_threshold_recovers_by_nudging(scale: float) -> None:
    """Without hold_band (Ok-Topk as published): after a jump in scale that throws the
    count out of the band, the nudges bring it back (about log(scale)/log(nudge) steps) and
    it stays there, with no recompute."""
    n, k = 50_000, 500
    x = gradient_like("gaussian", n, 9)
    est = sel.ReuseThreshold(k, interval=10_000, nudge=1.02, hold_band=False)
    est.select(x)
    x = (x * scale).astype(x.dtype)
    counts = [est.select(x).count for _ in range(20)]
    assert not est.band[0] * k <= counts[0] <= est.band[1] * k
    assert all(est.band[0] * k <= c <= est.band[1] * k for c in counts[12:]), counts
    assert est.recomputes == 1


@given(
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**32 - 1),
    scales=st.lists(st.floats(1e-3, 1e3), min_size=1, max_size=6),
    feedback=st.booleans(),
)
def test_reuse_threshold_holds_band_after_jumps(
    kind: str, seed: int, scales: list[float], feedback: bool
) -> None:
    """With hold_band (the default) every reuse call's count is within the band, whatever
    the scale does between calls and with error feedback lifting the unsent entries (the
    top k of the selection above the band, an exact recompute below it); the nudges still
    move the threshold up after a call above the band."""
    n, k = 20_000, 200
    rng = np.random.default_rng(seed)
    est = sel.ReuseThreshold(k, interval=10_000)
    residual = np.zeros(n, np.float32)
    for step, scale in enumerate([1.0, *scales]):
        x = (gradient_like(kind, n, int(rng.integers(2**32)), layout=seed) * scale).astype(
            np.float32
        )
        x = x + residual
        t = est.threshold
        s = est.select(x)
        check_selection(s, x)
        assert est.band[0] * k <= s.count <= est.band[1] * k, (step, s)
        if s.method == "reuse-topk":
            assert s.count == k and est.threshold == t * est.nudge
            np.testing.assert_array_equal(s.indices, topk_oracle(x, k))
        if feedback:
            residual = x.copy()
            residual[s.indices] = 0


def test_reuse_threshold_nudges() -> None:
    """Outside the band the threshold moves by the nudge factor, inside it stays."""
    est = sel.ReuseThreshold(100, interval=1000, nudge=1.5)
    assert est.due
    est.observe(100, 100, exact=2.0)
    assert not est.due
    assert est.threshold == 2.0
    est.observe(100, 100)
    assert est.threshold == 2.0
    est.observe(50, 100)
    assert est.threshold == 2.0 / 1.5
    est.observe(200, 100)
    assert est.threshold == 2.0
    with pytest.raises(ValueError, match="interval"):
        sel.ReuseThreshold(10, interval=0)


def test_reuse_threshold_after_fewer_than_k_nonzeros() -> None:
    """An exact call on fewer than k nonzeros has a k-th largest |x| of 0: the reuse calls
    select the nonzeros, not every entry (zeros included)."""
    x = np.zeros(1000, np.float32)
    x[:3] = [5, -4, 3]
    est = sel.ReuseThreshold(10, interval=4)
    assert est.select(x).count == 10  # the exact top-k: 3 nonzeros and 7 zeros
    assert est.threshold > 0.0
    for _ in range(3):
        s = est.select(x)
        assert s.method == "reuse" and s.indices.tolist() == [0, 1, 2]
    est = sel.ReuseThreshold(10, interval=4)
    est.observe(10, 10, exact=0.0)  # a global threshold of 0 from elsewhere: the same
    assert est.threshold > 0.0


def test_reuse_threshold_observe_refuses_what_it_misread() -> None:
    """observe() is the API for a threshold computed elsewhere (docs/guide/selection.md): a NaN or
    negative exact threshold became the smallest positive one (the reuse calls then took
    every nonzero), exact=True 1.0; count="5" or k=None raised the comparison's TypeError
    after the step had counted. Each is refused now, and the state stays as it was."""
    est = sel.ReuseThreshold(10, interval=4)
    with pytest.raises(ValueError, match="before any exact threshold"):
        est.observe(3, 10)
    for exact in (math.nan, -1.0):
        with pytest.raises(ValueError, match="exact must be a threshold >= 0"):
            est.observe(10, 10, exact=exact)
    with pytest.raises(TypeError, match="exact must be a real number"):
        est.observe(10, 10, exact=True)
    assert (est.step, est.recomputes, est.threshold) == (0, 0, None)
    est.observe(np.int64(10), np.int32(10), exact=np.float32(2.0))
    bad = [("5", 10, TypeError), (None, 10, TypeError), (5.0, 10, TypeError)]
    bad += [(-1, 10, ValueError), (5, None, TypeError), (5, -10, ValueError)]
    for count, k, err in bad:
        with pytest.raises(err, match="count|k"):
            est.observe(count, k)
    assert (est.step, est.recomputes, est.threshold) == (1, 1, 2.0)
    est.observe(5, 10)  # below the band: nudged down
    assert est.step == 2 and est.threshold == 2.0 / est.nudge


@pytest.mark.parametrize("hold_band", [True, False])
def test_reuse_threshold_never_nudged_to_zero_or_stuck_at_inf(hold_band: bool) -> None:
    """A nudge of 2 or more divided the smallest positive threshold (fewer than k nonzeros)
    to 0.0, and the next reuse call took every entry, zeros included; a threshold of inf
    (an exact call whose k-th |x| is inf) stayed inf, and the reuse calls took nothing."""
    x = np.zeros(1000, np.float32)
    x[::50] = 1.0  # 20 nonzeros, k = 50
    est = sel.ReuseThreshold(50, interval=8, nudge=2.0, hold_band=hold_band)
    for _ in range(6):
        s = est.select(x)
        assert est.threshold > 0.0 and not np.any(s.values[s.values == 0].shape[0] > 30)
        if s.method == "reuse":
            assert s.indices.tolist() == list(range(0, 1000, 50))
    est = sel.ReuseThreshold(3, interval=6, hold_band=hold_band)
    y = np.arange(1, 101, dtype=np.float32)
    est.select(np.where(np.arange(100) < 3, np.float32(np.inf), y))
    assert est.threshold == math.inf
    counts, ts = [], []
    for _ in range(4):
        counts.append(est.select(y).count)
        ts.append(est.threshold)
    # (without hold_band the nudge walks down from the largest finite value, as published;
    # with it, a reuse call below the band takes the exact top-k)
    assert all(math.isfinite(t) for t in ts) and ts == sorted(ts, reverse=True), ts
    assert not hold_band or counts == [3] * 4, counts


def test_reuse_threshold_with_k_zero() -> None:
    """k = 0 on a reuse call whose threshold selects entries (an infinity; or a density
    rounding k to 0 on a shorter vector): an empty selection, not a ValueError from the
    minimum of nothing."""
    for backend in ("numpy", "numba"):
        with sel.use_backend(backend):
            est = sel.ReuseThreshold(0, interval=4)
            x = np.array([1.0, np.inf, 2.0], np.float32)
            assert [est.select(x).count for _ in range(2)] == [0, 0]
            est = sel.ReuseThreshold(density=0.01, interval=4)
            rng = np.random.default_rng(0)
            est.select(rng.standard_normal(1000).astype(np.float32))
            s = est.select((10 * rng.standard_normal(40)).astype(np.float32))
            assert s.count == 0 and s.threshold == math.inf


def test_sampling_threshold_takes_no_zeros() -> None:
    """A sampled threshold of 0 (density so high that the sample's r-th |x| is 0) took every
    entry, zeros included, when that count fell in the band; now the nonzeros only."""
    n, k = 100_000, 80_000
    for seed in range(6):
        rng = np.random.default_rng(seed)
        x = np.zeros(n, np.float32)
        x[rng.choice(n, k, replace=False)] = rng.standard_normal(k).astype(np.float32) + 3
        s = sel.SamplingThreshold(k, seed=seed).select(x)
        assert np.count_nonzero(s.values == 0) == 0, (seed, s.method, s.threshold)


def test_trimmed_selections_report_their_smallest_kept_value() -> None:
    """A selection trimmed to its top k reports the smallest |value| it kept as its
    threshold (the Gaussian estimator reported its search's cut, below it)."""
    x = np.random.default_rng(0).standard_t(2, 200_000).astype(np.float32)  # heavy tails
    s = sel.GaussianThreshold(2000, retries=0).select(x)  # the normal fit's cut: too low
    assert s.method == "gaussian-topk" and s.count == 2000
    assert s.threshold == float(np.abs(s.values).min()) and sel.count_ge(x, s.threshold) == 2000


def quantised(kind: str, n: int, seed: int) -> np.ndarray:
    """Few distinct |values|: signs plus one step of residual (0, +-1, +-2, the +-2 rare),
    small integers, multiples of 1/4."""
    rng = np.random.default_rng(seed)
    if kind == "sign-residual":
        first = np.sign(rng.standard_normal(n))
        first[rng.random(n) < 0.002] = 0  # as if sent
        return (np.sign(rng.standard_normal(n)) + first).astype(np.float32)
    if kind == "integers":
        return rng.integers(-3, 4, n).astype(np.float32)
    return (np.round(rng.standard_normal(n) * 4) / 4).astype(np.float32)


@given(
    kind=st.sampled_from(["sign-residual", "integers", "quarters"]),
    seed=st.integers(0, 2**32 - 1),
    density=st.sampled_from([0.001, 0.01]),
)
def test_estimators_on_quantised_values(kind: str, seed: int, density: float) -> None:
    """Few distinct |values| (signs with a residual, small integers, bfloat16-like
    values): every estimator selects within its band, none raises (the Gaussian search's
    secant step on a nearly flat count overflowed math.exp)."""
    x = quantised(kind, 100_000, seed)
    k = round(density * x.shape[0])
    reuse = sel.ReuseThreshold(density=density, interval=2)
    reuse.select(x)  # exact; the next call reuses its threshold, on ties
    for est in (
        sel.SamplingThreshold(density=density, seed=seed),
        sel.GaussianThreshold(density=density),
        reuse,
    ):
        s = est.select(x)
        check_selection(s, x)
        assert est.band[0] * k <= s.count <= est.band[1] * k, (type(est).__name__, s)


def test_estimator_retries_validated() -> None:
    for est_cls in (sel.SamplingThreshold, sel.GaussianThreshold):
        with pytest.raises(ValueError, match="retries"):
            est_cls(10, retries=-1)
        with pytest.raises(TypeError, match="retries"):  # a float: the wrong type
            est_cls(10, retries=1.5)
    x = np.random.default_rng(5).standard_normal(20000).astype(np.float32)
    assert sel.SamplingThreshold(10, retries=0).select(x).count >= 8


def test_estimator_edges() -> None:
    x = np.random.default_rng(5).standard_normal(1000).astype(np.float32)
    for est_cls in (
        sel.ExactThreshold,
        sel.SamplingThreshold,
        sel.GaussianThreshold,
        sel.ReuseThreshold,
    ):
        for k in (0, 1000):
            s = est_cls(k).select(x)
            assert s.count == k
            assert s.k == k
        assert est_cls(k=5000).select(x).count == 1000  # k is capped at n
    s = sel.GaussianThreshold(10).select(np.full(100, 3.0, np.float32))  # std = 0
    assert s.count == 10
    assert s.method == "gaussian-exact"
    with pytest.raises(ValueError, match="exactly one"):
        sel.ExactThreshold()
    with pytest.raises(ValueError, match="exactly one"):
        sel.ExactThreshold(3, density=0.1)
    with pytest.raises(ValueError, match="density"):
        sel.ExactThreshold(density=1.5)
    with pytest.raises(ValueError, match="1-D"):
        sel.SamplingThreshold(3).select(np.ones((40, 40), np.float32))
    with pytest.raises(ValueError, match="NaN"):
        sel.GaussianThreshold(3).select(np.array([1.0, np.nan, 2.0, 3.0]))
    s = sel.ExactThreshold(density=0.01)(x)
    assert (s.requested_density, s.achieved_density, s.ratio) == (0.01, 0.01, 1.0)
    assert "count=10" in repr(s)
    v = s.to_sparse()
    assert v.n == 1000
    np.testing.assert_array_equal(v.indices, s.indices)


@pytest.mark.parametrize("name", ["numba", "numpy"])
@given(x=vectors(), extra=st.integers(0, 3), data=st.data())
def test_estimators_keep_their_count_contract_at_the_ends(name, x, extra, data) -> None:
    """Every estimator on the ends of the range (all equal, all zeros, ±0, subnormals,
    infinities, float16, heavy ties at the threshold; n from 0, k from 0 to n + 3, capped
    at n): exactly k (Exact, and every exact fallback or trim) or within the stated band,
    indices ascending, values = x[indices], no warning."""
    n = x.shape[0]
    k = data.draw(st.integers(0, n)) + extra
    want = min(k, n)
    with backend(name), warnings.catch_warnings():
        warnings.simplefilter("error")
        for est in (
            sel.ExactThreshold(k),
            sel.SamplingThreshold(k, min_sample=16),
            sel.GaussianThreshold(k),
        ):
            s = est.select(x)
            lo, hi = getattr(est, "lo", 1.0), getattr(est, "hi", 1.0)
            assert s.k == want and (s.count == want or lo * want <= s.count <= hi * want), s
            check_selection(s, x)


def test_estimators_same_on_both_backends() -> None:
    x = gradient_like("student", 80_000, 11)
    out = {}
    for name in ("numba", "numpy"):
        with backend(name):
            ests = (
                sel.ExactThreshold(400),
                sel.SamplingThreshold(400, seed=3),
                sel.ReuseThreshold(400, interval=2),
            )
            out[name] = [e.select(x) for e in ests] + [ests[-1].select(x * 1.01)]
    for a, b in zip(out["numba"], out["numpy"]):
        np.testing.assert_array_equal(a.indices, b.indices)
        assert (a.threshold, a.method, a.tries) == (b.threshold, b.method, b.tries)


def test_torch_tensors_come_back_as_torch() -> None:
    torch = pytest.importorskip("torch")
    x = torch.tensor([0.5, -3.0, 2.0, 0.0])
    idx, vals = sel.topk(x, 2)
    assert isinstance(idx, torch.Tensor)
    assert idx.tolist() == [1, 2]
    assert vals.tolist() == [-3.0, 2.0]
    s = sel.ExactThreshold(1).select(x)
    assert isinstance(s.indices, torch.Tensor)
    assert s.indices.tolist() == [1]


@pytest.mark.parametrize(
    ("env", "cores", "want"),
    [
        ({}, 8, 8),
        ({"MPI_LOCALNRANKS": "4"}, 8, 2),
        ({"MPI_LOCALNRANKS": "4"}, 2, 1),  # oversubscribed: one thread, never zero
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, 8, 2),
        ({"SLURM_NTASKS_PER_NODE": "2(x3),1"}, 8, 4),
        ({"MPI_LOCALNRANKS": "4", "SPARSECOLL_NUM_THREADS": "3"}, 8, 3),
        ({"MPI_LOCALNRANKS": "4", "NUMBA_NUM_THREADS": "8"}, 8, 8),
    ],
)
def test_thread_count_follows_ranks_per_node(monkeypatch, env, cores, want) -> None:
    for var in (*_numba_core.LOCAL_SIZE_VARS, "SPARSECOLL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(_numba_core, "_cores", lambda: cores)
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 8)
    monkeypatch.setattr(_numba_core, "_threads", None)
    assert _numba.get_num_threads() == want
    _numba.set_num_threads(1)
    assert sel.get_num_threads() == 1 or sel.backend() == "numpy"
    with pytest.raises(ValueError, match="threads"):
        _numba.set_num_threads(9)


@pytest.mark.parametrize("name", ["numba", "numpy"])
def test_set_num_threads_takes_integers_on_either_backend(monkeypatch, name: str) -> None:
    """A numpy integer is a count of threads (np.int64(2) was refused, "must be an
    integer"); what is no integer is a TypeError (a ValueError before); on the numpy backend
    -1 and "2" were taken silently."""
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 8)
    monkeypatch.setattr(_numba_core, "_threads", None)
    with sel.use_backend(name):
        sel.set_num_threads(np.int64(2))
        assert _numba_core._threads == (2 if name == "numba" else None)
        for bad in ("2", 2.0, True, None):
            with pytest.raises(TypeError, match="threads must be an integer"):
                sel.set_num_threads(bad)
        for bad in (0, -1):
            with pytest.raises(ValueError, match="threads must be an integer"):
                sel.set_num_threads(bad)
        assert _numba_core._threads == (2 if name == "numba" else None)


def test_small_arrays_never_start_the_thread_pool() -> None:
    """A fresh process selecting on arrays under PARALLEL_MIN uses only serial kernels: no
    Numba thread pool (whose idle OpenMP threads would spin on other ranks' cores)."""
    code = (
        "import numpy as np, sparsecoll.select as s\n"
        "from numba.np.ufunc import parallel\n"
        "x = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)\n"
        "s.topk(x, 100); s.threshold(x, 2.0); s.count_ge(x, 1.0); s.moments(x)\n"
        "s.GaussianThreshold(k=100).select(x)\n"
        "print(parallel._is_initialized)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr


# -- the fused error-feedback pass ---------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
@given(
    x=vectors(max_size=1000),  # past 64 per chunk: the pass's 64-element words
    data=st.data(),
    momentum=st.sampled_from([0.0, 0.9]),
    with_residual=st.booleans(),
)
def test_accumulate_matches_separate_passes(name, x, data, momentum, with_residual) -> None:
    """out = g + r (with momentum u' = m·u + g first), the entries of out[lo:hi] with
    |out| >= cut exactly as ``threshold`` would pick them, at most cap of them with every hit
    counted, the zero buffer zeroed (even when it is g), non-finite entries counted, and
    (nonzeros=True) the nonzeros of out[lo:hi] before zero_cut zeroed any."""
    n = x.shape[0]
    dt = x.dtype
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    r = (rng.standard_normal(n) * data.draw(st.sampled_from([0.0, 1.0, 100.0]))).astype(dt)
    u = rng.standard_normal(n).astype(dt)
    lo = data.draw(st.integers(0, n))
    hi = data.draw(st.integers(lo, n))
    cut = data.draw(st.sampled_from([0.0, 0.5, 1.0, 3.0, math.inf]))
    cap = data.draw(st.one_of(st.none(), st.integers(0, n + 1)))
    alias_zero = data.draw(st.booleans())
    zero_cut = data.draw(st.sampled_from([math.inf, 0.0, cut, 2.0, 5.0]))
    buckets = data.draw(st.booleans())
    nonzeros = data.draw(st.booleans())
    g = x.copy()
    with backend(name):
        out = dev(np.full(n, 7, dt), name)
        gd, rd, ud = dev(g, name), dev(r, name), dev(u, name)
        uo = dev(np.empty(n, dt), name) if momentum else None
        zero = gd if alias_zero else dev(np.ones(n, dt), name)
        with np.errstate(over="ignore", invalid="ignore"):
            src = (u * dt.type(momentum) + g).astype(dt) if momentum else g
            want = (src + r).astype(dt) if with_residual else src.copy()
        got = sel.accumulate(
            gd, rd if with_residual else None, out=out, cut=cut, lo=lo, hi=hi, cap=cap,
            velocity=ud if momentum else None, velocity_out=uo, momentum=momentum, zero=zero,
            zero_cut=zero_cut, buckets=buckets, nonzeros=nonzeros,
        )  # fmt: skip
    assert got.nonzeros == (np.count_nonzero(want[lo:hi]) if nonzeros else None)
    zeroed = np.zeros(n, bool)  # the entries returned with |value| >= zero_cut
    if got.complete and zero_cut < math.inf:
        zc = _common.round_threshold(zero_cut, dt)
        idx = host(got.indices)
        zeroed[idx[np.abs(host(got.values).astype(np.float64)) >= zc]] = True
    np.testing.assert_array_equal(host(out), np.where(zeroed, dt.type(0), want))
    if momentum:
        np.testing.assert_array_equal(host(uo), src)
    assert not host(zero).any()
    with np.errstate(invalid="ignore"):
        finite = np.isfinite(want)
    assert got.nonfinite == n - np.count_nonzero(finite)
    part = np.where(finite, want, 0)[lo:hi]  # non-finite entries: agreed on by the caller
    t = math.inf if cut == math.inf else (cut or float(np.finfo(dt).smallest_subnormal))
    hits = threshold_oracle(part, t) + lo
    hits = hits if cut != math.inf else np.flatnonzero(np.isinf(want[lo:hi])) + lo
    if got.nonfinite:
        return  # which non-finite entries count as hits is unspecified
    assert got.hits == hits.shape[0]
    room = hi - lo if cap is None else min(cap, hi - lo)
    idx = host(got.indices)
    assert idx.dtype == index_dtype(n)
    if got.complete:
        assert got.hits <= room
        np.testing.assert_array_equal(idx, hits)
        np.testing.assert_array_equal(host(got.values), want[hits])
    else:
        assert got.hits > idx.shape[0]


@pytest.mark.parametrize("name", BACKENDS)
@given(x=vectors(max_size=1000), data=st.data())
def test_topk_hits_matches_topk_of_the_hits(name, x, data) -> None:
    """topk_hits on an accumulate selection (its histogram of the hits kept or not, the
    k-th value in any bin, ties across it) gives the top-k of the selected entries: their
    indices, values and a mask over the selection, as topk would."""
    n = x.shape[0]
    assume(n > 0 and np.count_nonzero(np.abs(x) < np.inf) > 0)
    x = np.where(np.isinf(x), 0, x).astype(x.dtype)  # no infinities: a step raises on them
    a = np.abs(x.astype(np.float64))
    cut = data.draw(st.sampled_from([0.0, float(np.median(a)), float(a.max()) / 3]))
    with backend(name):
        found = sel.accumulate(
            dev(x, name), out=dev(np.empty(n, x.dtype), name), cut=cut,
            buckets=data.draw(st.booleans()),
        )  # fmt: skip
        assume(found.hits > 0)
        k = data.draw(st.integers(1, found.hits))
        idx, vals, taken = sel.topk_hits(found, k)
    hit_idx, hit_vals = host(found.indices), host(found.values)
    pos = topk_oracle(hit_vals, k)
    np.testing.assert_array_equal(host(idx), hit_idx[pos])
    np.testing.assert_array_equal(host(vals), hit_vals[pos])
    np.testing.assert_array_equal(np.flatnonzero(host(taken)), pos)


def test_topk_hits_rejects_incomplete_selections() -> None:
    x = np.arange(10, dtype=np.float32)
    found = sel.accumulate(x, out=np.empty(10, np.float32), cut=1.0, cap=3)
    with pytest.raises(ValueError, match="complete selection"):
        sel.topk_hits(found, 2)
    found = sel.accumulate(x, out=np.empty(10, np.float32), cut=8.0)
    with pytest.raises(ValueError, match="at least k=3"):
        sel.topk_hits(found, 3)
    for k in ("2", 2.0, True, None):  # (a str raised "'<=' not supported between ...")
        with pytest.raises(TypeError, match="k must be an integer"):
            sel.topk_hits(found, k)


def _at_offset(n: int, dt: np.dtype, offset: int) -> np.ndarray:
    """An n-element array starting ``offset`` elements after a 64-byte boundary."""
    buf = np.empty(n + 64, dt)
    first = (-buf.ctypes.data % 64) // dt.itemsize
    return buf[first + offset : first + offset + n]


@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("offsets", [(0, 0, 0), (3, 3, 3), (0, 1, 0), (2, 2, 5)])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_accumulate_streaming_stores_at_any_alignment(dt, offsets, momentum) -> None:
    """The Numba pass streams its stores from the first aligned element when every written
    array shares acc's alignment (else it stores plainly): the same results either way, at
    the chunk edges too (several chunks on several threads, lo/hi inside, a separate zero
    buffer and one that is grad), and the nonzeros of acc[lo:hi] counted in the pass
    (before it zeroes the hits from zero_cut up) where asked."""
    dt = np.dtype(dt)
    n = 5000
    rng = np.random.default_rng([*offsets, int(momentum * 10), dt.itemsize])
    g0 = (rng.standard_normal(n) * 3).astype(dt)
    g0[rng.random(n) < 0.3] = 0
    r0 = np.where(rng.random(n) < 0.5, 0, rng.standard_normal(n)).astype(dt)
    u0 = rng.standard_normal(n).astype(dt)
    src = (u0 * dt.type(momentum) + g0).astype(dt) if momentum else g0
    want = (src + r0).astype(dt)
    hits = np.flatnonzero(np.abs(want[700:4100]) >= 2.5) + 700
    for alias in (False, True):
        acc_off, z_off, uo_off = offsets
        g, r = _at_offset(n, dt, acc_off), _at_offset(n, dt, 7)
        g[:], r[:] = g0, r0
        acc, uo = _at_offset(n, dt, acc_off), _at_offset(n, dt, uo_off)
        zero = g if alias else _at_offset(n, dt, z_off)
        if not alias:
            zero[...] = 1
        with _small_chunks(), sel.use_backend("numba"):
            got = sel.accumulate(
                g, r, out=acc, cut=2.5, lo=700, hi=4100,
                velocity=u0.copy() if momentum else None,
                velocity_out=uo if momentum else None, momentum=momentum, zero=zero,
                nonzeros=alias,
            )  # fmt: skip
        assert got.nonzeros == (np.count_nonzero(want[700:4100]) if alias else None)
        np.testing.assert_array_equal(acc, want)
        if momentum:
            np.testing.assert_array_equal(uo, src)
        assert not zero.any()
        assert got.nonfinite == 0 and got.complete
        np.testing.assert_array_equal(got.indices, hits)
        np.testing.assert_array_equal(got.values, want[hits])


@contextlib.contextmanager
def _small_chunks() -> Iterator[None]:
    """The Numba kernels' chunked parallel paths on small arrays (2 threads where Numba has
    them)."""
    saved = _numba_core.MIN_CHUNK, _numba_core.PARALLEL_MIN, _numba_core._threads
    _numba_core.MIN_CHUNK, _numba_core.PARALLEL_MIN = 333, 1
    _numba_core._threads = min(2, numba.config.NUMBA_NUM_THREADS)
    try:
        yield
    finally:
        _numba_core.MIN_CHUNK, _numba_core.PARALLEL_MIN, _numba_core._threads = saved


@given(
    n=st.integers(0, 3000),
    data=st.data(),
    dt=st.sampled_from([np.float32, np.float64]),
    offset=st.integers(0, 7),
    divisor=st.sampled_from([1, 3]),
    chunked=st.booleans(),
)
def test_write_dense_is_zeros_and_the_scattered_values(n, data, dt, offset, divisor, chunked):
    """write_dense (a step's update, written whole after the collective) equals zeroing
    then ``update[idx] = vals / divisor``: at any alignment (streaming stores from the first
    aligned element), across chunk edges, for no indices, every index, the first and last,
    and indices out of order (the fallback)."""
    dt = np.dtype(dt)
    mask = data.draw(arrays(np.bool_, n))
    idx = np.flatnonzero(mask).astype(index_dtype(max(n, 1)))
    if data.draw(st.booleans()) and idx.shape[0] > 1:
        idx = idx[::-1].copy()
    vals = np.random.default_rng(n).standard_normal(idx.shape[0]).astype(dt) * 7
    update = _at_offset(n, dt, offset)
    update[...] = np.nan
    want = np.zeros(n, dt)
    want[idx] = vals / dt.type(divisor) if divisor != 1 else vals
    with _small_chunks() if chunked else contextlib.nullcontext():
        _numba_train.write_dense(update, idx, vals, divisor)
    np.testing.assert_array_equal(update, want)


def test_accumulate_workspace_keeps_its_memory() -> None:
    """With a workspace the pass's hits land in the same memory every call (no fresh pages
    to fault in), the results the same as without; a larger need gets a larger array."""
    rng = np.random.default_rng(5)
    work: dict = {}
    first = None
    for t, size in enumerate([4000, 4000, 9000]):
        g = rng.standard_normal(size).astype(np.float32)
        plain = sel.accumulate(g, out=np.empty(size, np.float32), cut=1.0)
        got = sel.accumulate(g, out=np.empty(size, np.float32), cut=1.0, workspace=work)
        np.testing.assert_array_equal(got.indices, plain.indices)
        np.testing.assert_array_equal(got.values, plain.values)
        if sel.backend() != "numba":
            continue
        assert np.shares_memory(got.indices, work["indices"])
        if t == 1:
            assert np.shares_memory(got.values, first)
        first = work["values"]
        assert work["indices"].shape[0] >= size


def test_accumulate_rejects_mismatched_buffers() -> None:
    g = np.ones(10, np.float32)
    with pytest.raises(TypeError, match="out must be a float32"):
        sel.accumulate(g, out=np.empty(10, np.float64))
    with pytest.raises(TypeError, match="residual"):
        sel.accumulate(g, np.ones(9, np.float32), out=np.empty(10, np.float32))
    with pytest.raises(ValueError, match="lo <= hi"):
        sel.accumulate(g, out=np.empty(10, np.float32), lo=5, hi=4)
    with pytest.raises(ValueError, match="velocity and velocity_out"):
        sel.accumulate(g, out=np.empty(10, np.float32), velocity=g)


@pytest.mark.parametrize("name", ["numba", "numpy"])
def test_accumulate_refuses_what_it_truncated_or_raised_raw(name: str) -> None:
    """lo, hi and cap are integers and momentum a number: int() took lo=1.7 as 1, "1" as 1,
    hi=True as 1, cap=2.5 as 2 and cap=-1 as no room (silently no entries), float() took
    momentum="0.5", bool() buckets="no" as True. An output buffer that is read-only or no
    array is named: a list raised AttributeError ('list' object has no attribute 'dtype'),
    a read-only out on Numba its compiler's TypingError, a list workspace AttributeError on
    Numba (and was ignored on numpy)."""
    g = np.array([3.0, -1.0, 2.0, -3.0, 0.5])

    def run(**kw):
        args = {"out": np.empty(5), "cut": 1.0, **kw}
        return sel.accumulate(g, args.pop("residual", None), **args)

    with backend(name):
        for bad in ({"lo": 1.7}, {"lo": "1"}, {"hi": True}, {"cap": 2.5}, {"lo": np.float64(1)}):
            with pytest.raises(TypeError, match=f"{next(iter(bad))} must be an integer >= 0"):
                run(**bad)
        with pytest.raises(ValueError, match="cap must be an integer >= 0, got -1"):
            run(cap=-1)
        v = {"velocity": np.ones(5), "velocity_out": np.empty(5)}
        with pytest.raises(TypeError, match="momentum must be a real number, got str"):
            run(momentum="0.5", **v)
        for where in ("out", "residual", "velocity_out", "zero"):
            kw = {**v, where: [0.0] * 5}
            with pytest.raises(TypeError, match=f"{where} must be a float64 array of shape"):
                run(**kw)
            if where != "residual":
                ro = np.zeros(5)
                ro.flags.writeable = False
                with pytest.raises(ValueError, match=f"{where} is read-only"):
                    run(**{**v, where: ro})
        for bad in ({"buckets": "no"}, {"nonzeros": 1}):  # (bool() took "no" as True)
            with pytest.raises(TypeError, match=f"{next(iter(bad))} must be True or False"):
                run(**bad)
        with pytest.raises(TypeError, match="workspace must be a dict or None, got list"):
            run(workspace=[])
        # what it takes: numpy integers, a cap above the room, momentum a numpy float
        got = run(lo=np.int64(1), hi=np.uint8(4), cap=99, momentum=np.float32(0.5), **v)
        assert got.indices.tolist() == [2, 3]  # (out = 0.5 + g: -0.5 at 1 is below the cut)
        assert got.values.tolist() == [2.5, -2.5]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_accumulate_int64_indices(dtype) -> None:
    """The Numba pass with int64 indices (what n > 2**31 gets) on a small vector: the same
    hits, values, zeroing and histogram as with int32."""
    rng = np.random.default_rng(7)
    n = 70_001  # blocks of 64 and a tail of each kind
    g = rng.standard_normal(n).astype(dtype)
    r = rng.standard_normal(n).astype(dtype)
    acc = np.empty(n, dtype)
    lo, hi = 1_000, 69_000
    idx, vals, hits, nbad, found, count = _numba_train.accumulate(
        g, r, None, None, 0.0, acc, None, 2.0, lo, hi, n, np.int64, 3.0, True, None, True
    )
    a = g + r
    want = lo + np.flatnonzero(np.abs(a[lo:hi]) >= 2.0)
    assert idx.dtype == np.int64 and hits == want.shape[0] and nbad == 0
    np.testing.assert_array_equal(idx, want)
    np.testing.assert_array_equal(vals, a[want])
    zeroed = a.copy()
    zeroed[want[np.abs(a[want]) >= 3.0]] = 0
    np.testing.assert_array_equal(acc, zeroed)
    assert int(found.counts.sum()) == hits
    assert count == np.count_nonzero(a[lo:hi])


def test_accumulate_workspace_apart() -> None:
    """The pass's hits go to the workspace: values half a page from indices (so their
    writes at one running position never share an L1 set), reused across calls, and
    the hits are right on every call, also after the workspace had to grow."""
    from sparsecoll.select._numba_train import PAGE

    rng = np.random.default_rng(11)
    workspace: dict = {}
    for n, cut in ((50_000, 2.0), (50_000, 1.0), (120_000, 1.5), (90_000, 2.5)):
        g = rng.standard_normal(n).astype(np.float32)
        r = rng.standard_normal(n).astype(np.float32)
        acc = np.empty(n, np.float32)
        idx, vals, hits, _, _, _ = _numba_train.accumulate(
            g, r, None, None, 0.0, acc, None, cut, 0, n, n, np.int32, np.inf, False, workspace
        )
        a = g + r
        want = np.flatnonzero(np.abs(a) >= np.float32(cut))
        np.testing.assert_array_equal(idx, want)
        np.testing.assert_array_equal(vals, a[want])
        assert hits == want.shape[0]
        assert (vals.ctypes.data - idx.ctypes.data) % PAGE == PAGE // 2
        assert np.shares_memory(vals, workspace["values"])
        assert np.shares_memory(idx, workspace["indices"])
