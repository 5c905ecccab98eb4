"""The "sparsecoll" torch.distributed backend under mpiexec: init_process_group, the dense
collectives, sparse all_reduce equal to the dense sum (hybrid tensors too), async Works,
bad input raised on every rank, DDP with a sparse embedding equal to gloo's. Each test runs
over the MPI transport and, where sparsecoll.integrations.torch._comm is there, over the
torch one (skipped when torch is not installed, on every rank alike)."""

from __future__ import annotations

import hashlib
import importlib.util
import os

import numpy as np
import pytest

import sparsecoll

from .cases import assert_all

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from sparsecoll.integrations import torch as sc_torch  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*is deprecated:FutureWarning",  # (torch's own calls of its renamed functions)
    "ignore:Sparse invariant checks:UserWarning",
    "ignore:Sparse CSR tensor support is in beta:UserWarning",
)
TRANSPORTS = ["mpi"]
if importlib.util.find_spec("sparsecoll.integrations.torch._comm") is not None:
    TRANSPORTS.append("torch")


@pytest.fixture(scope="module")
def world(comm):
    """torch.distributed's default group on the sparsecoll backend (rank and size MPI's)."""
    sc_torch.init_process_group(comm, backend="sparsecoll")
    yield dist.group.WORLD
    dist.destroy_process_group()


_groups: dict = {}


@pytest.fixture(params=TRANSPORTS)
def group(request, world):
    """A sparsecoll group of every rank over each transport: the default group (MPI's),
    a new group over torch (built once)."""
    transport = request.param
    if transport == "mpi":
        return world
    if transport not in _groups:
        options = {"transport": transport}
        _groups[transport] = dist.new_group(backend="sparsecoll", pg_options=options)
    return _groups[transport]


def _like(group) -> dict:
    """pg_options for a new group over ``group``'s transport."""
    return {"transport": "torch"} if type(group.comm).__name__ == "TorchCommunicator" else {}


def _digest(t) -> str:
    t = t.coalesce()
    h = hashlib.sha256()
    for part in (t.indices(), t.values().float()):
        h.update(part.contiguous().numpy().tobytes())
    return h.hexdigest()


def test_init_process_group(world, comm):
    """backend "sparsecoll" is the default group's, of MPI's rank and size."""
    assert_all(comm, dist.get_backend() == "sparsecoll", dist.get_backend())
    assert_all(comm, (dist.get_rank(), dist.get_world_size()) == (comm.rank, comm.size))


def test_dense_collectives(group, comm):
    """Every dense collective DDP and scripts use works through the gloo group it holds."""
    g = {"group": group}
    r, p = comm.rank, comm.size
    problems = []
    x = torch.full((4,), float(r + 1))
    dist.all_reduce(x, **g)
    if not torch.equal(x, torch.full((4,), p * (p + 1) / 2)):
        problems.append(f"all_reduce {x}")
    x = torch.full((3,), float(r))
    dist.all_reduce(x, op=dist.ReduceOp.AVG, **g)
    if not torch.allclose(x, torch.full((3,), (p - 1) / 2)):
        problems.append(f"all_reduce AVG {x}")
    x = torch.full((2,), float(r))
    dist.all_reduce(x, op=dist.ReduceOp.MAX, **g)
    if not torch.equal(x, torch.full((2,), p - 1.0)):
        problems.append(f"all_reduce MAX {x}")
    b = torch.arange(5.0) if r == p - 1 else torch.zeros(5)
    dist.broadcast(b, p - 1, **g)
    if not torch.equal(b, torch.arange(5.0)):
        problems.append(f"broadcast {b}")
    out = [torch.empty(2) for _ in range(p)]
    dist.all_gather(out, torch.full((2,), float(r)), **g)
    if not all(torch.equal(o, torch.full((2,), float(i))) for i, o in enumerate(out)):
        problems.append(f"all_gather {out}")
    flat = torch.empty(2 * p)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(r)), **g)
    if not torch.equal(flat, torch.arange(p).float().repeat_interleave(2)):
        problems.append(f"all_gather_into_tensor {flat}")
    part = torch.empty(2)
    dist.reduce_scatter_tensor(part, torch.arange(2.0 * p) + r, **g)
    want = (torch.arange(2.0 * p) * p + p * (p - 1) / 2)[2 * r : 2 * r + 2]
    if not torch.equal(part, want):
        problems.append(f"reduce_scatter_tensor {part}")
    one = torch.empty(1)
    dist.reduce_scatter(one, [torch.full((1,), float(i)) for i in range(p)], **g)
    if one.item() != p * r:
        problems.append(f"reduce_scatter {one}")
    a2a = torch.empty(p)
    dist.all_to_all_single(a2a, torch.arange(p).float() + 10 * r, **g)
    if not torch.equal(a2a, torch.arange(p).float() * 10 + r):
        problems.append(f"all_to_all_single {a2a}")
    outs = [torch.empty(1) for _ in range(p)]
    dist.all_to_all(outs, [torch.full((1,), 10.0 * r + i) for i in range(p)], **g)
    if not all(o.item() == 10 * i + r for i, o in enumerate(outs)):
        problems.append(f"all_to_all {outs}")
    dist.barrier(**g)
    got = torch.zeros(3)
    if r % 2 == 0 and r + 1 < p:
        dist.send(torch.full((3,), float(r)), group_dst=r + 1, **g)
    elif r % 2 == 1:
        dist.recv(got, group_src=r - 1, **g)
        if not torch.equal(got, torch.full((3,), r - 1.0)):
            problems.append(f"recv {got}")
    assert_all(comm, not problems, "; ".join(problems))


def _tensor(rank: int, seed: int, shape: tuple, sparse_dim: int, dtype, nnz: int):
    """Rank ``rank``'s sparse tensor (any rank can build any other's): ``nnz`` random sparse
    positions, repeats left in (uncoalesced)."""
    rng = np.random.default_rng([seed, rank])
    idx = np.stack([rng.integers(0, s, nnz) for s in shape[:sparse_dim]]) if nnz else None
    if idx is None:
        idx = np.zeros((sparse_dim, 0), dtype=np.int64)
    vals = rng.standard_normal((nnz, *shape[sparse_dim:]))
    return torch.sparse_coo_tensor(
        torch.from_numpy(idx), torch.from_numpy(vals).to(dtype), shape, check_invariants=True
    )


CASES = [
    # (shape, sparse_dim, dtype, nnz per rank: -1 gives rank 0 none)
    ((50,), 1, torch.float64, 7),
    ((40, 6), 1, torch.float32, 5),  # an embedding's gradient: rows of 6
    ((40, 6), 1, torch.float32, -1),
    ((8, 9, 3), 2, torch.float64, 6),
    ((30, 4), 2, torch.float32, 12),
    ((16, 5), 1, torch.bfloat16, 4),
    ((16, 5), 1, torch.float16, 4),
]


@pytest.mark.parametrize(("shape", "sparse_dim", "dtype", "nnz"), CASES)
def test_sparse_all_reduce_is_the_dense_sum(group, comm, shape, sparse_dim, dtype, nnz):
    """The result is the dense sum (to the dtype's rounding), coalesced, of the input's
    layout, in place, and identical on every rank."""
    seed = len(shape) * 100 + abs(nnz)
    counts = [abs(nnz) if (nnz >= 0 or r) else 0 for r in range(comm.size)]
    t = _tensor(comm.rank, seed, shape, sparse_dim, dtype, counts[comm.rank])
    want = sum(_tensor(r, seed, shape, sparse_dim, dtype, counts[r]).double().to_dense()
               for r in range(comm.size))  # fmt: skip
    work = dist.all_reduce(t, group=group)
    tol = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-5}.get(dtype, 1e-12)
    problems = []
    if work is not None:
        problems.append(f"dist.all_reduce returned {work!r}")
    if not (t.is_sparse and t.is_coalesced() and t.dtype == dtype):
        problems.append(f"layout: sparse {t.is_sparse}, coalesced {t.is_coalesced()}, {t.dtype}")
    if (t.sparse_dim(), tuple(t.shape)) != (sparse_dim, shape):
        problems.append(f"sparse_dim {t.sparse_dim()}, shape {tuple(t.shape)}")
    err = (t.double().to_dense() - want).abs().max().item()
    if err > tol * (1 + want.abs().max().item()):
        problems.append(f"differs from the dense sum by {err}")
    assert_all(comm, not problems, "; ".join(problems))
    digests = comm.allgather_object(_digest(t))
    assert_all(comm, len(set(digests)) == 1, "results differ across ranks")


def test_sparse_all_reduce_avg(group, comm):
    """AVG is the sum divided by the group's size."""
    t = _tensor(comm.rank, 5, (20, 3), 1, torch.float64, 4)
    want = sum(_tensor(r, 5, (20, 3), 1, torch.float64, 4).to_dense() for r in range(comm.size))
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)
    assert_all(comm, torch.allclose(t.to_dense(), want / comm.size, atol=1e-12))


@pytest.mark.parametrize("algorithm", ["allgather", "dsa", "recursive_doubling", "dense"])
def test_algorithm_by_option_and_environment(group, comm, algorithm):
    """pg_options' "algorithm" chooses the algorithm, else SPARSECOLL_TORCH_ALGORITHM."""
    options = {"algorithm": algorithm, **_like(group)}
    by_option = dist.new_group(backend="sparsecoll", pg_options=options)
    os.environ["SPARSECOLL_TORCH_ALGORITHM"] = algorithm
    try:
        by_env = dist.new_group(backend="sparsecoll")
    finally:
        del os.environ["SPARSECOLL_TORCH_ALGORITHM"]
    want = sum(_tensor(r, 9, (30, 2), 1, torch.float64, 5).to_dense() for r in range(comm.size))
    problems = []
    for g in (by_option, by_env):
        if g.algorithm != algorithm:
            problems.append(f"algorithm {g.algorithm!r}")
        t = _tensor(comm.rank, 9, (30, 2), 1, torch.float64, 5)
        dist.all_reduce(t, group=g)
        if not torch.allclose(t.to_dense(), want, atol=1e-12):
            problems.append(f"{g.algorithm}: not the dense sum")
    assert_all(comm, not problems, "; ".join(problems))


def test_async(group, comm):
    """async_op=True returns at once a Work per call; they complete in call order with the
    sums, result() holding the tensor reduced in place; a dense call between them works."""
    ts = [_tensor(comm.rank, 20 + i, (25, 4), 1, torch.float32, 6) for i in range(4)]
    wants = [sum(_tensor(r, 20 + i, (25, 4), 1, torch.float32, 6).to_dense()
                 for r in range(comm.size)) for i in range(4)]  # fmt: skip
    works = [dist.all_reduce(t, group=group, async_op=True) for t in ts]
    x = torch.ones(2)
    dist.all_reduce(x, group=group)
    problems = []
    for i, (w, t, want) in enumerate(zip(works, ts, wants)):
        w.wait()
        if not w.is_completed() or w.result()[0] is not t:
            problems.append(f"work {i}: completed {w.is_completed()}")
        if not torch.allclose(t.to_dense(), want, atol=1e-5):
            problems.append(f"work {i}: not the dense sum")
        fut = w.get_future()
        if not fut.done() or fut.value()[0] is not t:
            problems.append(f"work {i}: future")
    if not torch.equal(x, torch.full((2,), float(comm.size))):
        problems.append("dense all_reduce between them")
    assert_all(comm, not problems, "; ".join(problems))


def _raises_alike(comm, call, match: str) -> None:
    """``call()`` raises a SparseCollError matching ``match`` on every rank, with the same
    message everywhere."""
    try:
        call()
    except sparsecoll.SparseCollError as exc:
        got = f"{type(exc).__name__}: {exc}"
    else:
        got = "nothing raised"
    every = comm.allgather_object(got)
    assert_all(comm, len(set(every)) == 1, f"messages differ: {every}")
    assert_all(comm, bool(__import__("re").search(match, got)), got)


def test_bad_input_raises_on_every_rank(group, comm):
    """Shapes, dtypes or ops that differ across ranks, MAX, an integer tensor: the same
    error on every rank, naming the rank; the group works on afterwards."""
    bad = comm.rank == comm.size - 1
    last = comm.size - 1
    if comm.size > 1:  # (what differs across ranks needs two of them)
        _mismatches_raise_alike(group, comm, bad, last)
    t = _tensor(comm.rank, 1, (8, 3), 1, torch.float32, 3)
    if comm.size > 1:
        op = dist.ReduceOp.MAX if bad else dist.ReduceOp.SUM
        _raises_alike(
            comm,
            lambda: dist.all_reduce(t, op=op, group=group),
            f"sparse all_reduce takes SUM or AVG, got MAX on rank {last}",
        )
    _raises_alike(
        comm,
        lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group),
        "sparse all_reduce takes SUM or AVG, got MAX on rank 0",
    )
    ints = torch.sparse_coo_tensor([[1, 2]], torch.tensor([1, 2]), (5,))
    _raises_alike(
        comm,
        lambda: dist.all_reduce(ints, group=group),
        "sparse all_reduce takes float tensors, got torch.int64 on rank 0",
    )
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)
    _raises_alike(comm, work.wait, "SUM or AVG")
    t = _tensor(comm.rank, 2, (8, 3), 1, torch.float32, 3)
    want = sum(_tensor(r, 2, (8, 3), 1, torch.float32, 3).to_dense() for r in range(comm.size))
    dist.all_reduce(t, group=group)
    assert_all(comm, torch.allclose(t.to_dense(), want, atol=1e-5), "after the errors")


def _mismatches_raise_alike(group, comm, bad: bool, last: int) -> None:
    """A shape, dtype or sparse_dim that one rank alone has: the same error everywhere."""
    shape = (9 if bad else 8, 3)
    t = _tensor(comm.rank, 1, shape, 1, torch.float32, 3)
    _raises_alike(
        comm,
        lambda: dist.all_reduce(t, group=group),
        rf"sparse tensor shape must be the same on every rank: rank {last} has \(9, 3\), "
        rf"rank 0 has \(8, 3\)",
    )
    t = _tensor(comm.rank, 1, (8, 3), 1, torch.float64 if bad else torch.float32, 3)
    _raises_alike(comm, lambda: dist.all_reduce(t, group=group), "dtype must be the same")
    t = _tensor(comm.rank, 1, (8, 3), 2, torch.float32, 3)  # (8, 3) with 2 sparse dims
    if bad:
        t = _tensor(comm.rank, 1, (8, 3), 1, torch.float32, 3)
    _raises_alike(
        comm,
        lambda: dist.all_reduce(t, group=group),
        f"sparse dims must be the same on every rank: rank {last} has 1, rank 0 has 2",
    )


def test_dense_and_sparse_mixed_raise_on_every_rank(group, comm):
    """A dense tensor on one rank where the others pass a sparse one (either way round), a
    sparse CSR tensor, an op that differs: the same error on every rank, naming the rank,
    where the ranks took different paths and hung; the group works on afterwards."""
    last = comm.size - 1
    t = _tensor(comm.rank, 4, (8, 3), 1, torch.float32, 3)
    if comm.size > 1:
        mixed = t.to_dense() if comm.rank == last else t
        _raises_alike(
            comm,
            lambda: dist.all_reduce(mixed, group=group),
            rf"tensor layout must be the same on every rank: rank {last} has dense, rank 0 "
            rf"has sparse COO",
        )
        mixed = t if comm.rank == last else t.to_dense()
        _raises_alike(
            comm,
            lambda: dist.all_reduce(mixed, group=group, async_op=True).wait(),
            rf"rank {last} has sparse COO, rank 0 has dense",
        )
        x = torch.ones(3)
        op = dist.ReduceOp.MAX if comm.rank == last else dist.ReduceOp.SUM
        _raises_alike(
            comm,
            lambda: dist.all_reduce(x, op=op, group=group),
            rf"op must be the same on every rank: rank {last} has 'MAX', rank 0 has 'SUM'",
        )
    csr = t.to_dense().to_sparse_csr() if comm.rank == last else t
    _raises_alike(
        comm,
        lambda: dist.all_reduce(csr, group=group),
        rf"all_reduce takes dense or sparse COO tensors, got torch.sparse_csr on rank {last}",
    )
    want = sum(_tensor(r, 4, (8, 3), 1, torch.float32, 3).to_dense() for r in range(comm.size))
    dist.all_reduce(t, group=group)
    x = torch.ones(3)
    dist.all_reduce(x, group=group)
    ok = torch.allclose(t.to_dense(), want, atol=1e-5) and torch.equal(
        x, torch.full((3,), comm.size * 1.0)
    )
    assert_all(comm, ok, "after the errors")


def test_selecting_or_unknown_algorithm_raises_on_every_rank(group, comm):
    """A selecting algorithm (not the sum) or an unknown name: raised at the first sparse
    all_reduce, on every rank."""
    t = _tensor(comm.rank, 1, (8, 3), 1, torch.float32, 3)
    g = dist.new_group(
        backend="sparsecoll", pg_options={"algorithm": "gtopk", "k": 2, **_like(group)}
    )
    _raises_alike(comm, lambda: dist.all_reduce(t, group=g), "needs an exact algorithm")
    g = dist.new_group(backend="sparsecoll", pg_options={"algorithm": "no-such", **_like(group)})
    _raises_alike(comm, lambda: dist.all_reduce(t, group=g), "no-such")


def _ddp_run(group, rank: int, steps: int) -> list:
    """Train a sparse embedding and a dense layer under DDP on ``group``; the parameters."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {"emb": torch.nn.Embedding(60, 8, sparse=True), "out": torch.nn.Linear(8, 1)}
    )

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            return self.m["out"](self.m["emb"](x).mean(dim=1))

    ddp = DistributedDataParallel(Net(), process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randint(0, 60, (5, 4), generator=gen)
        y = torch.randn(5, 1, generator=gen)
        opt.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in ddp.module.parameters()]


def test_ddp_sparse_embedding_matches_gloo(group, comm):
    """DDP with nn.Embedding(sparse=True) and a dense layer on the sparsecoll backend: after
    20 steps the parameters are identical on every rank and within 1e-5 of the same run on
    gloo."""
    gloo = dist.new_group(backend="gloo")
    ours = _ddp_run(group, comm.rank, 20)
    theirs = _ddp_run(gloo, comm.rank, 20)
    diff = max((a - b).abs().max().item() for a, b in zip(ours, theirs))
    assert_all(comm, diff <= 1e-5, f"max abs diff to gloo {diff}")
    digest = hashlib.sha256(b"".join(p.numpy().tobytes() for p in ours)).hexdigest()
    every = comm.allgather_object(digest)
    assert_all(comm, len(set(every)) == 1, "parameters differ across ranks")


def test_comm_hook_on_a_sparsecoll_group(world, comm):
    """The DDP communication hook (dense gradients sparsified over MPI) runs on a model whose
    process group is the sparsecoll backend's: the parameters stay identical across ranks."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Linear(40, 3), process_group=world)
    state = sc_torch.SparseHookState(algorithm="oktopk", density=0.2)
    ddp.register_comm_hook(state, sc_torch.sparse_allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(4):
        gen = torch.Generator().manual_seed(100 * step + comm.rank)
        opt.zero_grad()
        ddp(torch.randn(8, 40, generator=gen)).square().mean().backward()
        opt.step()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in ddp.parameters()))
    every = comm.allgather_object(digest.hexdigest())
    assert_all(comm, len(set(every)) == 1, "parameters differ across ranks")
    assert_all(comm, state.stats()["bytes_sent_total"] > 0, "the hook sent nothing")
