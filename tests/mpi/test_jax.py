"""JAX arrays under mpiexec, at P = 2 and 3 only: bits equal to the numpy path, jax.Array
results, bad input raising on every rank inside and outside ``jax.jit``, and the guide's
examples (docs/guide/jax.md) with their parameters identical across ranks. Skipped on every
rank alike without jax."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import sparsecoll

from ..docexamples import examples

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
sc_jax = pytest.importorskip("sparsecoll.integrations.jax")

RANK = MPI.COMM_WORLD.Get_rank()
EXAMPLES = examples("jax")


def _data(seed, m=400, n=2000, dtype=np.float32):
    rng = np.random.default_rng([seed, RANK])
    return rng.standard_normal(m).astype(dtype), rng.integers(0, n, m).astype(np.int32)


@pytest.mark.parametrize("algorithm", ["allgather", "dsa", "recursive_doubling", "gtopk"])
def test_allreduce_bits_equal_numpy(comm, algorithm):
    vals, idx = _data(1)
    opts = {"k": 50} if algorithm == "gtopk" else {}
    ref = sparsecoll.allreduce(comm, vals, idx, n=2000, algorithm=algorithm, **opts)
    out = sparsecoll.allreduce(
        comm, jnp.asarray(vals), jnp.asarray(idx), n=2000, algorithm=algorithm, **opts
    )
    assert isinstance(out.values, jax.Array) and isinstance(out.indices, jax.Array)
    assert np.asarray(out.values).tobytes() == ref.values.tobytes()
    assert np.array_equal(np.asarray(out.indices), ref.indices)
    req = sparsecoll.iallreduce(comm, jnp.asarray(vals), jnp.asarray(idx), n=2000)
    got = req.wait()
    assert isinstance(got.values, jax.Array)
    exact = sparsecoll.allreduce(comm, vals, idx, n=2000)
    assert np.asarray(got.values).tobytes() == exact.values.tobytes()


@pytest.mark.parametrize("algorithm", ["oktopk", "exdyna"])
def test_reducer_bits_equal_numpy_in_and_out_of_jit(comm, algorithm):
    n = 3000
    ref, eager, traced = (
        sparsecoll.GradientReducer(comm, n=n, algorithm=algorithm, density=0.02) for _ in range(3)
    )
    step = jax.jit(lambda g: sc_jax.step(traced, g))
    for s in range(6):
        g = jax.random.normal(jax.random.fold_in(jax.random.key(s), RANK), (30, 100))
        want = ref.step(np.asarray(g)).tobytes()
        a, b = eager.step(g), step(g)
        assert isinstance(a, jax.Array) and isinstance(b, jax.Array) and b.shape == (30, 100)
        assert np.asarray(a).tobytes() == want and np.asarray(b).tobytes() == want
        assert len(set(comm.allgather_object(want))) == 1


def test_independent_calls_in_one_program_match_numpy(comm):
    """Two reducers stepped in one jitted function with no data between them, then a loop of
    steps: every rank runs the calls in the same order, and the bits equal the numpy path."""
    n = 1200

    def reducers():
        return [
            sparsecoll.GradientReducer(comm, n=n, algorithm=a, density=0.05)
            for a in ("oktopk", "allgather")
        ]

    traced, ref = reducers(), reducers()

    def program(g, h):
        u, w = sc_jax.step(traced[0], g), sc_jax.step(traced[1], h)
        looped = jax.lax.fori_loop(0, 2, lambda i, x: sc_jax.step(traced[1], x), u)
        return u, w, looped

    f = jax.jit(program)
    for s in range(3):
        key = jax.random.fold_in(jax.random.key(s), RANK)
        g, h = jax.random.normal(key, (2, n))
        u, w, looped = f(g, h)
        want_u = ref[0].step(np.asarray(g))
        want_w = ref[1].step(np.asarray(h))
        want_looped = ref[1].step(ref[1].step(want_u))
        assert np.asarray(u).tobytes() == want_u.tobytes()
        assert np.asarray(w).tobytes() == want_w.tobytes()
        assert np.asarray(looped).tobytes() == want_looped.tobytes()


def test_jit_allreduce_fixed_capacity(comm):
    vals, idx = _data(2, m=50, n=100)
    ref = sparsecoll.allreduce(comm, vals[:40], idx[:40], n=100)
    f = jax.jit(lambda v, i: sc_jax.allreduce(v, i, n=100, capacity=100, count=40, comm=comm))
    i, v, c = f(jnp.asarray(vals), jnp.asarray(idx))
    assert int(c) == ref.nnz
    assert np.array_equal(np.asarray(i)[: ref.nnz], ref.indices)
    assert np.asarray(v)[: ref.nnz].tobytes() == ref.values.tobytes()
    assert (np.asarray(i)[ref.nnz :] == 100).all()
    dense = jax.jit(lambda x: sc_jax.allreduce_dense(x, comm=comm))(jnp.asarray(vals))
    assert np.array_equal(np.asarray(dense), sum(comm.allgather_object(vals)))


def _bad_grads(n):
    """Per case, this rank's gradient: rank 1's is bad."""
    return {
        "dtype": (jnp.zeros(n, jnp.int32) if RANK == 1 else jnp.zeros(n), "got int32 on rank 1"),
        "size": (jnp.zeros(n + RANK), "got 101 on rank 1"),
    }


@pytest.mark.parametrize("case", ["dtype", "size"])
def test_bad_input_raises_on_every_rank(comm, case):
    n = 100
    grad, message = _bad_grads(n)[case]
    r = sparsecoll.GradientReducer(comm, n=n, algorithm="oktopk", density=0.1)
    kind = sparsecoll.CollectiveTypeError if case == "dtype" else sparsecoll.CollectiveInputError
    with pytest.raises(kind, match=message):  # outside jit, the array path
        r.step(grad)
    with pytest.raises(kind, match=message):  # outside jit, through the callback
        sc_jax.step(r, grad)
    step = jax.jit(lambda g: sc_jax.step(r, g))
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        step(grad).block_until_ready()
    with pytest.raises(kind, match=message), sc_jax.original_errors():
        step(grad).block_until_ready()
    # every rank goes on in step
    assert np.asarray(step(jnp.ones(n))).shape == (n,) and r.steps == 1


def test_allreduce_errors_on_every_rank_in_jit(comm):
    f = jax.jit(lambda v, i: sc_jax.allreduce(v, i, n=10, capacity=10, comm=comm))
    v = jnp.ones(3, jnp.int32) if RANK == 1 else jnp.ones(3)
    with pytest.raises(sparsecoll.CollectiveTypeError, match="on rank 1"), sc_jax.original_errors():
        f(v, jnp.arange(3)).block_until_ready()
    full = jnp.ones(4)
    with pytest.raises(ValueError, match="over capacity=2"):  # the same sum on every rank
        sc_jax.allreduce(full, jnp.arange(4), n=10, capacity=2, comm=comm)


@pytest.mark.parametrize("example", EXAMPLES, ids=[ex.id for ex in EXAMPLES])
def test_guide_examples(comm, example):
    example.run()  # (the training example asserts its parameters are equal on every rank)
    comm.barrier()
