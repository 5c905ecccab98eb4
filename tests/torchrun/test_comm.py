"""TorchCommunicator under torchrun (no MPI): every algorithm over a gloo process group.

Exact algorithms equal the dense sum (tests/mpi/cases.py's oracle), gtopk equals the
sequential merge tree, oktopk's result is well formed and identical everywhere, one rank's
bad input raises on every rank, the primitives move what they say and count it.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sparsecoll
from sparsecoll.algorithms.gtopk import gtopk_tree
from sparsecoll.comm import Request
from sparsecoll.registry import algorithm_class

from ..mpi.cases import KINDS, assert_all, assert_identical, cases, digest, local_input, mismatch
from ..mpi.selecting import all_inputs, well_formed

EXACT = [a for a in sparsecoll.available_algorithms() if algorithm_class(a).exact]
FEW = settings(max_examples=min(settings().max_examples, 25))


def test_no_mpi():
    assert "mpi4py" not in sys.modules  # (checked again at the end: nothing imports it)


@pytest.mark.parametrize("name", EXACT)
@FEW
@given(case=cases(kinds=(*KINDS, "cancel")))
def test_exact_equals_dense_sum(comm, name, case):
    if algorithm_class(name).densifies and case.huge:
        return
    vals, idx = local_input(case, comm.rank, comm.size)
    out = sparsecoll.allreduce(comm, vals, idx, n=case.n, algorithm=name)
    why = mismatch(out, case, comm.size)
    assert_all(comm, why is None, f"{name}: {why}")
    assert_identical(comm, out)
    stats = out.info["stats"]
    assert_all(comm, comm.size > 1 or stats.bytes_sent == 0, f"P = 1 moved {stats}")


@FEW
@given(case=cases(), k=st.one_of(st.integers(0, 8), st.integers(9, 400)))
def test_gtopk_equals_sequential_tree(comm, case, k):
    inputs = all_inputs(case, comm.size)
    x = inputs[comm.rank]
    out = sparsecoll.allreduce(comm, x.values, x.indices, n=case.n, algorithm="gtopk", k=k)
    want, _ = gtopk_tree(inputs, k)
    why = well_formed(out, case.n, case.dtype, k) or (
        digest(out) != digest(want) and "differs from the sequential tree"
    )
    assert_all(comm, not why, str(why))


@FEW
@given(case=cases(max_n=100_000), k=st.integers(1, 200))
def test_oktopk_runs(comm, case, k):
    x = all_inputs(case, comm.size)[comm.rank]
    algo = sparsecoll.get_algorithm("oktopk", k=k)
    out = sparsecoll.allreduce(comm, x.values, x.indices, n=case.n, algorithm=algo)
    why = well_formed(out, case.n, case.dtype, case.n)
    assert_all(comm, not why, str(why))
    assert_identical(comm, out)


BAD = {
    # what: (error type, text in the message; needs P > 1)
    "out_of_range": (sparsecoll.CollectiveInputError, "out of range", False),
    "n": (sparsecoll.CollectiveInputError, "n must be the same", True),
    "dtype": (sparsecoll.CollectiveTypeError, "dtype must be the same", True),
}


@pytest.mark.filterwarnings("ignore:.*by name builds a new instance")
@pytest.mark.parametrize("name", sparsecoll.available_algorithms())
@pytest.mark.parametrize("what", sorted(BAD))
def test_bad_input_raises_everywhere(comm, name, what):
    etype, text, multi = BAD[what]
    if multi and comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    rng = np.random.default_rng(comm.rank)
    n, bad = 1000, comm.size - 1
    idx, vals = rng.integers(0, n, 20), rng.standard_normal(20).astype(np.float32)
    if comm.rank == bad:
        if what == "out_of_range":
            idx[3] = n + 5
        elif what == "n":
            n += 1
        else:
            vals = vals.astype(np.float64)
    options = algorithm_class(name).default_options(1000, 20)
    try:
        sparsecoll.allreduce(comm, vals, idx, n=n, algorithm=name, **options)
        got = None
    except Exception as exc:  # every rank must land here with the same error
        got = (exc, str(exc))
    ok = got is not None and isinstance(got[0], etype)
    assert_all(comm, ok, f"expected {etype.__name__}, got {got!r}")
    msgs = comm.allgather_object(got[1])
    assert_all(comm, len(set(msgs)) == 1, f"messages differ: {msgs}")
    assert_all(comm, text in got[1] and f"rank {bad}" in got[1], f"message: {got[1]!r}")


def test_bad_alltoallv_counts_raise_everywhere(comm):
    buf = np.arange(4 * comm.size, dtype=np.float32)
    counts = [4] * comm.size
    if comm.rank == comm.size - 1:
        counts[0] = -1
    with pytest.raises(sparsecoll.CollectiveInputError, match=f"rank {comm.size - 1}"):
        comm.alltoallv(buf, counts)


def test_dense_allreduce(comm):
    for dtype in (np.float16, np.float32, np.float64):
        buf = np.full(5, comm.rank + 1, dtype=dtype)
        total = comm.allreduce(buf)
        want = comm.size * (comm.size + 1) / 2
        assert total.dtype == dtype and np.all(total == want)
        mean = comm.allreduce(buf, op="mean")
        assert np.allclose(mean, want / comm.size)
        comm.allreduce(buf, out=buf)  # in place
        assert np.all(buf == want)
    if comm.size > 1:
        mine = np.zeros(3, dtype=np.float32 if comm.rank else np.float64)
        with pytest.raises(sparsecoll.CollectiveTypeError, match="dtype"):
            comm.allreduce(mine)


def test_point_to_point(comm):
    """Tags keep messages apart (received in another order than sent), a message of
    unknown length (empty too) arrives whole, messages to self wait in order; each
    payload is counted, its header as metadata."""
    me, size = comm.rank, comm.size
    right, left = (me + 1) % size, (me - 1) % size
    first, second = np.arange(me, me + 7, dtype=np.int64), np.full(3, me, dtype=np.float32)
    with comm.measure() as st_:
        sends = [comm.isend(first, right, tag=1), comm.isend(second, right, tag=2)]
        got2, got1 = np.empty(3, dtype=np.float32), np.empty(7, dtype=np.int64)
        reqs = [comm.irecv(got2, left, tag=2), comm.irecv(got1, left, tag=1)]
        Request.waitall(reqs + sends)
    assert np.array_equal(got1, np.arange(left, left + 7)) and np.all(got2 == left)
    if size > 1:
        assert st_.bytes_sent == first.nbytes + second.nbytes == st_.bytes_recv
        assert st_.messages_sent == 2 and st_.meta_bytes_sent == 16
    else:
        assert st_.bytes_sent == 0 and st_.meta_bytes_sent == 0
    for length in (0, 1, 1000):
        # (a blocking send returns once the receiver has taken it: gloo has no eager sends)
        req = comm.isend(np.full(length + me, 5, dtype=np.uint8), right, tag=3)
        got = comm.recv_bytes(left, tag=3)
        req.wait()
        assert got.dtype == np.uint8 and got.shape == (length + left,) and np.all(got == 5)
    out = np.empty(2, dtype=np.int64)
    comm.sendrecv(np.array([me, 9]), right, out, left, tag=4)
    assert out.tolist() == [left, 9]
    assert comm.sendrecv_ints(me, right, left, tag=5) == left
    comm.barrier()


def test_allgatherv_counts_what_it_moves(comm):
    parts = [np.arange(r + 1, dtype=np.float64) for r in range(comm.size)]
    with comm.measure() as st_:
        out, counts = comm.allgatherv(parts[comm.rank])
    assert counts == [r + 1 for r in range(comm.size)]
    assert np.array_equal(out, np.concatenate(parts))
    others = sum(p.nbytes for p in parts) - parts[comm.rank].nbytes
    assert st_.bytes_recv == others
    assert st_.bytes_sent == (comm.size - 1) * parts[comm.rank].nbytes
    assert comm.allgather_object({"rank": comm.rank}) == [{"rank": r} for r in range(comm.size)]
    assert comm.bcast_object(("from", comm.rank), comm.size - 1) == ("from", comm.size - 1)


def test_nonblocking(comm, process_group):
    """iallreduce over a TorchCommunicator: requests in flight complete with the blocking
    call's results while the user's own calls on the group go on (the engine's messages
    travel on a group of its own); GradientReducer.step_async too."""
    import torch
    import torch.distributed as dist

    rng = np.random.default_rng([7, comm.rank])
    names = ["allgather", "dsa", "recursive_doubling", "allgather"]
    inputs = [(rng.standard_normal(20).astype(np.float32), rng.integers(0, 100, 20)) for _ in names]
    reqs = [
        sparsecoll.iallreduce(comm, v, i, n=100, algorithm=a) for (v, i), a in zip(inputs, names)
    ]
    x = torch.ones(3)
    dist.all_reduce(x, group=process_group)  # (the user's own call, the requests in flight)
    outs = [r.wait() for r in reqs]
    problems = [] if x.tolist() == [comm.size] * 3 else [f"the user's all_reduce: {x}"]
    for k, ((v, i), out) in enumerate(zip(inputs, outs)):
        want = sparsecoll.allreduce(comm, v, i, n=100)
        if not (np.array_equal(out.indices, want.indices) and np.allclose(out.values, want.values)):
            problems.append(f"request {k} differs from the blocking call")
    red = sparsecoll.GradientReducer(comm, n=500, algorithm="oktopk", density=0.05)
    grad = rng.standard_normal(500).astype(np.float32)
    update = red.step_async(grad).wait()
    digests = comm.allgather_object(update.tobytes())
    if any(d != digests[0] for d in digests):
        problems.append("step_async's updates differ across ranks")
    assert_all(comm, not problems, "; ".join(problems))


def test_blocking_and_nonblocking_mixed_raise_alike(comm):
    """Rank 0 starts a nonblocking call where the others make a blocking one (the engine's
    first start on a fresh communicator): every rank raises, naming both calls."""
    fresh = type(comm)(comm.group)
    one = (np.ones(1, np.float32), np.zeros(1, np.int64))
    try:
        if comm.rank == 0:
            sparsecoll.iallreduce(fresh, *one, n=4).wait()
        else:
            sparsecoll.allreduce(fresh, *one, n=4)
    except sparsecoll.SparseCollError as exc:
        got = str(exc)
    else:
        got = "nothing raised"
    ok = comm.size == 1 or "blocking and nonblocking calls mixed" in got
    assert_all(comm, ok, got)


def test_the_watchdog_is_refused_without_loading_mpi(comm):
    sparsecoll.set_timeout(30)
    try:
        with pytest.raises(NotImplementedError, match="watchdog"):
            sparsecoll.allreduce(comm, np.ones(1, np.float32), np.zeros(1, np.int64), n=4)
    finally:
        sparsecoll.set_timeout(None)


def test_gradient_reducer(comm):
    n = 1000
    red = sparsecoll.GradientReducer(comm, n=n, algorithm="oktopk", density=0.05)
    rng = np.random.default_rng(comm.rank)
    for _ in range(3):
        update = red.step(rng.standard_normal(n).astype(np.float32))
        digests = comm.allgather_object(update.tobytes())
        assert_all(comm, all(d == digests[0] for d in digests), "updates differ")
    assert red.stats()["bytes_sent"] > 0 or comm.size == 1


def test_torch_tensors_in_and_out(comm):
    import torch

    vals = torch.full((3,), float(comm.rank + 1))
    idx = torch.tensor([0, 2, 2])
    out = sparsecoll.allreduce(comm, vals, idx, n=5, algorithm="dsa")
    total = comm.size * (comm.size + 1) / 2
    assert isinstance(out.values, torch.Tensor)
    assert out.indices.tolist() == [0, 2] and out.values.tolist() == [total, 2 * total]


def test_still_no_mpi():
    assert "mpi4py" not in sys.modules
