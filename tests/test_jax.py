"""JAX arrays through the library on one process (MPI.COMM_SELF): kind, device and bits kept,
inside and outside ``jax.jit``; jax is imported only when such an array comes."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import sparsecoll

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
sc_jax = pytest.importorskip("sparsecoll.integrations.jax")


@pytest.fixture(scope="module")
def comm():
    from mpi4py import MPI

    return MPI.COMM_SELF


@pytest.fixture(params=["ffi", "io_callback"])
def path(request, monkeypatch):
    """Each jitted test runs on both paths: the XLA FFI call and ``io_callback``."""
    monkeypatch.setenv("SPARSECOLL_JAX_FFI", "1" if request.param == "ffi" else "0")
    return request.param


def test_import_does_not_import_jax():
    code = "import sys, sparsecoll, sparsecoll.integrations.jax; print('jax' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"


@pytest.mark.parametrize("algorithm", ["allgather", "dense", "gtopk"])
def test_allreduce_jax_in_jax_out_bit_identical(comm, algorithm):
    rng = np.random.default_rng(0)
    vals = rng.standard_normal(300).astype(np.float32)
    idx = rng.integers(0, 1000, 300).astype(np.int32)
    opts = {"k": 40} if algorithm == "gtopk" else {}
    ref = sparsecoll.allreduce(comm, vals, idx, n=1000, algorithm=algorithm, **opts)
    out = sparsecoll.allreduce(
        comm, jnp.asarray(vals), jnp.asarray(idx), n=1000, algorithm=algorithm, **opts
    )
    assert isinstance(out.values, jax.Array) and isinstance(out.indices, jax.Array)
    assert out.values.devices() == jnp.asarray(vals).devices()
    assert np.asarray(out.values).tobytes() == ref.values.tobytes()
    assert np.array_equal(np.asarray(out.indices), ref.indices)
    dense = out.to_dense()
    assert isinstance(dense, jax.Array) and np.array_equal(np.asarray(dense), ref.to_dense())


def test_iallreduce_returns_jax(comm):
    vals, idx = jnp.array([1.0, 2.0, 3.0]), jnp.array([4, 1, 4])
    out = sparsecoll.iallreduce(comm, vals, idx, n=5).wait()
    assert isinstance(out.values, jax.Array)
    assert np.asarray(out.values).tolist() == [2.0, 4.0]


@pytest.mark.parametrize("reuse", [False, True])
def test_reducer_step_jax_in_jax_out(comm, reuse):
    a = sparsecoll.GradientReducer(comm, n=600, algorithm="oktopk", density=0.05)
    b = sparsecoll.GradientReducer(comm, n=600, algorithm="oktopk", density=0.05)
    a.reuse_update = reuse
    kept = []
    for s in range(4):
        g = jax.random.normal(jax.random.key(s), (20, 30))
        u = a.step(g)
        assert isinstance(u, jax.Array) and u.shape == (20, 30) and u.dtype == g.dtype
        ref = b.step(np.asarray(g))
        assert np.asarray(u).tobytes() == ref.tobytes()
        kept.append((u, ref.copy()))
    # a JAX array is immutable: the reused buffer is copied, never lent
    assert all(np.array_equal(np.asarray(u), r) for u, r in kept)


def test_jax_out_is_refused(comm):
    r = sparsecoll.GradientReducer(comm, n=10, algorithm="oktopk", density=0.5)
    with pytest.raises(ValueError, match="read-only"):
        r.step(jnp.ones(10), out=jnp.zeros(10))


def test_traced_array_points_to_the_integration(comm):
    f = jax.jit(lambda v: sparsecoll.allreduce(comm, v, jnp.arange(3), n=3).values)
    with pytest.raises(TypeError, match=r"sparsecoll\.integrations\.jax"):
        f(jnp.ones(3))


def test_jit_step_bit_identical(comm, path):
    a = sparsecoll.GradientReducer(comm, n=1000, algorithm="exdyna", density=0.02)
    b = sparsecoll.GradientReducer(comm, n=1000, algorithm="exdyna", density=0.02)
    f = jax.jit(lambda g: sc_jax.step(a, g))
    for s in range(5):
        g = jax.random.normal(jax.random.key(s), (1000,))
        u = f(g)
        assert isinstance(u, jax.Array)
        assert np.asarray(u).tobytes() == b.step(np.asarray(g)).tobytes()


def test_jit_allreduce_fixed_capacity(comm, path):
    vals = jnp.array([1.0, 2.0, 3.0, 9.0], jnp.float32)
    idx = jnp.array([4, 1, 4, 0])
    f = jax.jit(lambda v, i, c: sc_jax.allreduce(v, i, n=6, capacity=5, count=c, comm=comm))
    i, v, c = f(vals, idx, 3)
    assert int(c) == 2 and i.dtype == jnp.int32
    assert np.asarray(i).tolist() == [1, 4, 6, 6, 6]
    assert np.asarray(v).tolist() == [2.0, 4.0, 0.0, 0.0, 0.0]
    dense = jnp.zeros(6).at[i].add(v, mode="drop")
    assert np.asarray(dense).tolist() == [0, 2, 0, 0, 4, 0]
    with pytest.raises(ValueError, match="over capacity=1"):
        sc_jax.allreduce(vals, idx, n=6, capacity=1, comm=comm)


def test_jit_allreduce_dense(comm, path):
    x = jnp.array([[0.0, 1.5], [0.0, -2.0]], jnp.float32)
    y = jax.jit(lambda x: sc_jax.allreduce_dense(x, comm=comm))(x)
    assert y.shape == (2, 2) and np.array_equal(np.asarray(y), np.asarray(x))


def test_errors_inside_and_outside_jit(comm, path):
    r = sparsecoll.GradientReducer(comm, n=8, algorithm="oktopk", density=0.5)
    bad = jnp.zeros(8, jnp.int32)
    with pytest.raises(sparsecoll.CollectiveTypeError, match="float16, float32 or float64"):
        sc_jax.step(r, bad)  # outside jit: the library's own error
    f = jax.jit(lambda g: sc_jax.step(r, g))
    with pytest.raises(jax.errors.JaxRuntimeError, match="CollectiveTypeError"):
        f(bad).block_until_ready()
    with (
        pytest.raises(sparsecoll.CollectiveInputError, match="8 elements, got 9"),
        sc_jax.original_errors(),
    ):
        f(jnp.zeros(9)).block_until_ready()
    assert np.asarray(f(jnp.ones(8))).shape == (8,)  # the reducer steps on


def test_the_cpu_path_is_an_ffi_call(comm, path):
    from sparsecoll.integrations.jax import _ffi

    text = jax.jit(lambda x: sc_jax.allreduce_dense(x, comm=comm)).lower(jnp.ones(4)).as_text()
    assert (_ffi.TARGET in text) == (path == "ffi")
    assert ("callback" in text) == (path == "io_callback")


def test_calls_run_in_program_order(comm, path):
    """Calls with no data between them run in the order the program makes them, each once,
    every time the program runs: in the function's body, in a loop body, and after it."""
    from sparsecoll.integrations.jax import _ops

    seen = []

    def tag(name):
        def run(ins, outs):
            seen.append(name)
            outs[0][...] = ins[0]

        return run

    shape = [jax.ShapeDtypeStruct((3,), jnp.float32)]

    def call(name, x):
        return _ops._call(tag(name), shape, x)[0]

    def body(x, y):
        return call("a", x) + call("b", y) + call("c", x + y)

    def program(x, y):
        looped, _ = jax.lax.scan(lambda c, _: (call("loop", c), None), x, None, length=2)
        return body(y, x) + looped + call("after", y)

    x, y = jnp.ones(3), jnp.full(3, 2.0)
    for fn, order, value in [(body, "abc", 6.0), (program, "LLabcZ", 9.0)]:
        seen.clear()
        f = jax.jit(fn)
        for _ in range(3):
            out = f(x, y)
        jax.block_until_ready(out)
        names = {"L": "loop", "Z": "after"}
        assert seen == [names.get(ch, ch) for ch in order] * 3
        assert np.asarray(out).tolist() == [value] * 3


def test_calls_in_a_function_body_keep_fast_dispatch(comm, path):
    """On the FFI path a program whose calls are all in its body has no JAX effect (JAX
    dispatches it from C++); one with a call in a loop body carries the ordered effect."""
    r = sparsecoll.GradientReducer(comm, n=6, algorithm="oktopk", density=0.5)

    def body(g):
        return sc_jax.step(r, g) + sc_jax.allreduce_dense(g, comm=comm)

    def looped(g):
        return jax.lax.fori_loop(0, 2, lambda i, g: sc_jax.step(r, g), g)

    g = jnp.ones(6)
    assert (not jax.make_jaxpr(body)(g).effects) == (path == "ffi")
    assert jax.make_jaxpr(looped)(g).effects


def test_a_body_compiled_inside_another_function_raises(comm, path):
    """A function traced alone first, its calls chained in its body, then called twice from
    another jitted function: its calls' order is not kept there, so compiling raises."""
    if path != "ffi":
        pytest.skip("io_callback calls are ordered by JAX's effect everywhere")
    inner = jax.jit(lambda x: sc_jax.allreduce_dense(x, comm=comm))
    x = jnp.arange(4.0)
    inner(x)
    outer = jax.jit(lambda x: inner(x) + inner(2 * x))
    with pytest.raises(ValueError, match="inside another function or a loop"):
        outer(x)
    jax.clear_caches()  # (traced within the outer function, its calls carry the effect)
    assert np.asarray(outer(x)).tolist() == [0.0, 3.0, 6.0, 9.0]


@pytest.mark.parametrize("direct", [False, True])
def test_a_call_outside_jit_waits_for_programs_dispatched_before(comm, path, direct):
    """JAX dispatches asynchronously; a library call made after a jitted program was
    dispatched runs after that program's calls (as on every rank), whether an entry point
    or a Communicator method called directly."""
    import time

    from sparsecoll.integrations.jax import _ops

    done = []

    def slow(ins, outs):
        time.sleep(0.3)
        outs[0][...] = ins[0]
        done.append(True)

    shape = [jax.ShapeDtypeStruct((1 << 21,), jnp.float32)]
    f = jax.jit(lambda x: _ops._call(slow, shape, jnp.sin(x) + x)[0])
    x = jnp.ones(1 << 21)
    f(x).block_until_ready()
    done.clear()
    out = f(x)  # (a program this large runs on XLA's threads: dispatch returns at once)
    if direct:
        sparsecoll.Communicator(comm).allgather_ints(1)
    else:
        sparsecoll.allreduce(comm, np.ones(2, np.float32), np.arange(2), n=4)
    assert done == [True]
    out.block_until_ready()
