"""The DDP communication hook in a real 2-rank run: gloo set up from MPI, a tiny model trained
with the default hook and with ours (skipped when torch is not installed).

The test launches this very file under ``mpiexec -n 2`` (one short run: torch is slow to
import); the ranks check, collectively:
* density 1.0 (warm-up 1 iteration, then the sparse path with every entry) gives the same
  parameters as DDP's default allreduce hook;
* allgather, gtopk, oktopk and exdyna at density 0.1 train (the loss falls), parameters stay
  identical on both ranks, and each sends fewer bytes than dense;
* DDP rebuilt its buckets after the first iteration and the hook coped (several buckets);
* the asynchronous hook (buckets reduced on the progress thread while backward goes on)
  gives bit for bit the parameters of the synchronous one, warm-up iterations included.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
import warnings

import pytest

STEPS = 20


@pytest.mark.mpi
def test_ddp_hook_two_ranks():
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (pip install 'sparsecoll[torch]')")
    from .mpirun import run_mpi

    proc = run_mpi(2, [__file__], timeout=300)
    assert proc.returncode == 0, f"ddp hook run failed:\n{proc.stdout[-8000:]}"
    assert proc.stdout.count("ddp hook ok") == 2, proc.stdout[-4000:]


class _Bucket:
    """A stand-in for dist.GradBucket: the hook state's own bookkeeping, in one process."""

    def __init__(self, index: int, count: int, buf, params):
        self.i, self.count, self.buf, self.params = index, count, buf, params

    def buffer(self):
        return self.buf

    def index(self) -> int:
        return self.i

    def is_last(self) -> bool:
        return self.i == self.count - 1

    def parameters(self):
        return self.params


def test_an_iteration_cut_short_leaves_no_trace():
    """An iteration whose backward ended before its last bucket (its bucket 0 stepped) must
    not be taken back by a later failed iteration, nor make the clean ones after it fail:
    before, bucket 0's reducer was taken back twice ('no step to take back' replaced the
    NonFiniteError) and every later iteration took its steps back and raised."""
    torch = pytest.importorskip("torch")
    from mpi4py import MPI

    from sparsecoll.integrations.torch import SparseHookState, sparse_allreduce_hook

    state = SparseHookState(MPI.COMM_SELF, algorithm="allgather", density=0.25, warmup=1)
    params = [[torch.zeros(8)], [torch.zeros(8)]]

    def iteration(grad1, cut_short=False):
        futures = [sparse_allreduce_hook(state, _Bucket(0, 2, torch.arange(8.0), params[0]))]
        if not cut_short:
            futures.append(sparse_allreduce_hook(state, _Bucket(1, 2, grad1, params[1])))
        return futures

    for _ in range(2):
        for f in iteration(torch.ones(8)):
            f.wait()
    iteration(None, cut_short=True)
    bad = torch.ones(8)
    bad[3] = float("nan")
    f0, f1 = iteration(bad)
    f0.wait()
    with pytest.raises(RuntimeError, match="NonFiniteError|not finite"):
        f1.wait()
    for _ in range(2):  # clean iterations go on
        for f in iteration(torch.ones(8)):
            f.wait()
    assert [red.steps for red in state.reducers.values()] == [5, 3]  # (the NaN step: none)


def _train(torch, ddp_cls, hook_state, hook, rank: int, steps: int = STEPS, dtype=None):
    """Train a tiny MLP on a learnable rule; return (parameters, losses, bucket count)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 4),
    ).to(dtype or torch.float32)
    # a tiny bucket cap: several buckets, so the rebuild after iteration 0 matters
    ddp = ddp_cls(model, bucket_cap_mb=0.002)
    if hook_state is not None:
        ddp.register_comm_hook(hook_state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.2)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(128, 8, generator=gen)
    y = (x[:, :4] - x[:, 4:]).argmax(dim=1)  # the same rule on every rank
    x = x.to(dtype or torch.float32)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [p.detach().clone() for p in model.parameters()], losses


class _Ledger:
    """DDP with the hook on a small MLP, lr 0 and a fixed batch (the same gradient every
    iteration), and what error feedback must conserve: per parameter, Σ p.grad · P +
    Σ residuals == Σ gradients over the iterations counted."""

    def __init__(self, torch, ddp_cls, comm) -> None:
        self.torch, self.ddp_cls, self.comm = torch, ddp_cls, comm
        self.x = torch.randn(16, 7, generator=torch.Generator().manual_seed(comm.Get_rank()))

    def model(self):
        self.torch.manual_seed(0)
        nn = self.torch.nn
        return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3))

    def build(self, state, static=False, hook=None, **ddp_options):
        """(model, ddp, order): order maps a bucket index to its parameters' positions in
        the model, in bucket order."""
        from sparsecoll.integrations.torch import sparse_allreduce_hook

        hook = hook or sparse_allreduce_hook
        model = self.model()
        ddp = self.ddp_cls(model, static_graph=static, **ddp_options)
        order = {}

        def recording(state, bucket):
            pos = {id(p): i for i, p in enumerate(model.parameters())}
            order[bucket.index()] = [pos[id(p)] for p in bucket.parameters()]
            return hook(state, bucket)

        ddp.register_comm_hook(state, recording)
        return model, ddp, order

    def run(self, model, ddp, steps, acc):
        for _ in range(steps):
            ddp.zero_grad()
            ddp(self.x).pow(2).mean().backward()
            for a, p in zip(acc, model.parameters()):
                a += p.grad.double().reshape(-1).numpy()

    def lost(self, model, state, order, acc, steps):
        import numpy as np

        plain = self.model()
        plain(self.x).pow(2).mean().backward()
        params = list(model.parameters())
        res = [np.zeros(p.numel()) for p in params]
        for index, red in state.reducers.items():
            r, off = np.asarray(red.residual, dtype=np.float64), 0
            for i in order[index]:
                res[i] += r[off : off + params[i].numel()]
                off += params[i].numel()
        worst, comm = 0.0, self.comm
        for a, r, p in zip(acc, res, plain.parameters()):
            grads = comm.allreduce(p.grad.double().reshape(-1).numpy()) * steps
            worst = max(worst, float(np.abs(a * comm.Get_size() + comm.allreduce(r) - grads).max()))
        return worst


def _resume_into_fresh_ddp(torch, ddp_cls, comm) -> list[str]:
    """A hook state saved after 3 iterations and restored into a fresh DDP (a restarted job),
    and a static graph (DDP rebuilds its buckets after the second iteration): per parameter,
    error feedback loses nothing, Σ p.grad · P + residual == Σ gradients. One bucket holds
    every parameter, in the reverse order after DDP's rebuild: the hook matched buckets by
    size only, so a fresh DDP's first bucket took the saved residual in the wrong order, as
    did the rebuilt bucket of a static graph (lr 0 and a fixed batch: the same gradient each
    step)."""
    import pickle
    import warnings

    import numpy as np

    from sparsecoll.integrations.torch import SparseHookState

    problems, ledger = [], _Ledger(torch, ddp_cls, comm)
    state = SparseHookState(comm, "allgather", density=0.1)
    model, ddp, order = ledger.build(state)
    acc = [np.zeros(p.numel()) for p in model.parameters()]
    ledger.run(model, ddp, 3, acc)
    saved = pickle.loads(pickle.dumps(state.state_dict()))
    state = SparseHookState(comm, "allgather", density=0.1)
    state.load_state_dict(saved)
    model, ddp, order = ledger.build(state)
    ledger.run(model, ddp, 3, acc)
    if (err := ledger.lost(model, state, order, acc, 6)) > 1e-5:
        problems.append(f"restored into a fresh DDP: a parameter's gradients are off by {err}")
    for warmup in (1, 2):
        state = SparseHookState(comm, "allgather", density=0.1, warmup=warmup)
        model, ddp, order = ledger.build(state, static=True)
        acc = [np.zeros(p.numel()) for p in model.parameters()]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ledger.run(model, ddp, 4, acc)
        warned = any("changed" in str(w.message) for w in caught)
        if warmup == 1 and not warned:
            problems.append("static graph, warmup=1: the rebuilt bucket gave no warning")
        if warmup == 2 and (warned or (err := ledger.lost(model, state, order, acc, 4)) > 1e-5):
            problems.append(f"static graph, warmup=2: warned {warned}, gradients off by {err}")
    return problems


def _skipped_iteration_loses_nothing(torch, ddp_cls, comm) -> list[str]:
    """An iteration in which one bucket fails (Inf in one parameter's gradient on rank 0)
    is skipped by the training loop (nonfinite="raise": backward raises, the batch is
    dropped; "nan": the bucket comes back NaN and the step is not taken): the buckets that
    stepped in it, before or after the failing one, take their residual back, so nothing
    is lost over the run, Σ p.grad · P + Σ residuals == Σ gradients of the iterations
    kept. Before, their sent entries were lost with the batch; and the asynchronous hook's
    backward raised as soon as the failed bucket's future did, with the later buckets still
    queued, writing into buffers DDP had handed to the next iteration. Both hooks, a
    selecting algorithm of each kind, the failure in the first and in the last bucket."""
    import numpy as np

    from sparsecoll.integrations.torch import (
        SparseHookState,
        async_sparse_allreduce_hook,
        sparse_allreduce_hook,
    )

    problems, ledger = [], _Ledger(torch, ddp_cls, comm)
    steps, skip = 6, 3
    cases = [
        (hook, algorithm, nonfinite, where)
        for hook in (sparse_allreduce_hook, async_sparse_allreduce_hook)
        for algorithm, nonfinite, where in (
            ("allgather", "raise", 0),
            ("gtopk", "nan", 2),
            ("oktopk", "raise", 2),
            ("exdyna", "nan", 0),
        )
    ]
    bad = {"now": False}  # whether the next backward puts Inf into the target's gradient
    for hook, algorithm, nonfinite, where in cases:
        state = SparseHookState(comm, algorithm, density=0.1, nonfinite=nonfinite)
        model, ddp, order = ledger.build(state, hook=hook, bucket_cap_mb=0.0001)
        target = model[where].weight
        target.register_hook(
            lambda g: g.index_fill(1, torch.tensor([0]), float("inf")) if bad["now"] else g
        )
        acc = [np.zeros(p.numel()) for p in model.parameters()]
        what = f"{hook.__name__}, {algorithm}, nonfinite={nonfinite!r}, layer {where}"
        for t in range(steps):
            if t != skip:
                ledger.run(model, ddp, 1, acc)
                continue
            bad["now"] = comm.Get_rank() == 0
            ddp.zero_grad()
            try:
                ddp(ledger.x).pow(2).mean().backward()
                failed = not all(bool(p.grad.isfinite().all()) for p in model.parameters())
            except RuntimeError as exc:
                failed = "NonFiniteError" in str(exc)
            bad["now"] = False
            if not failed:
                problems.append(f"{what}: the iteration with Inf did not fail")
            # every bucket but the failed one stepped before backward returned (the
            # asynchronous hook's error came back while later buckets were still queued)
            stepped = sum(red.steps for red in state.reducers.values())
            if stepped != skip * len(state.reducers) - 1:
                problems.append(f"{what}: backward returned with buckets in flight")
        if len(order) < 2:
            problems.append(f"{what}: expected several buckets, got {len(order)}")
        if (err := ledger.lost(model, state, order, acc, steps - 1)) > 1e-5:
            problems.append(f"{what}: a parameter's gradients are off by {err:.3g}")
    return problems


def _bfloat16_buckets(torch, ddp_cls, comm) -> list[str]:
    """A bfloat16 model: both hooks reduce its buckets (numpy has no bfloat16: the hook
    raised TypeError on every bucket, warm-up included) through float32, with float32
    residuals; the parameters agree across ranks and between the hooks, and train."""
    import numpy as np

    from sparsecoll.integrations.torch import (
        SparseHookState,
        async_sparse_allreduce_hook,
        sparse_allreduce_hook,
    )

    problems, runs = [], []
    for hook in (sparse_allreduce_hook, async_sparse_allreduce_hook):
        for algorithm in ("allgather", "exdyna"):
            state = SparseHookState(comm, algorithm, density=0.1)
            try:
                params, losses = _train(
                    torch, ddp_cls, state, hook, comm.Get_rank(), steps=6, dtype=torch.bfloat16
                )
            except Exception as exc:
                problems.append(f"bfloat16, {hook.__name__}, {algorithm}: {exc!r:.200}")
                continue
            runs.append(params)
            flat = torch.cat([p.float().reshape(-1) for p in params]).numpy()
            if not all(np.array_equal(o, flat) for o in comm.allgather(flat)):
                problems.append(f"bfloat16, {algorithm}: parameters differ across ranks")
            dtypes = {str(r.residual.dtype) for r in state.reducers.values()}
            if dtypes != {"float32"} or not losses[-1] < losses[0]:
                problems.append(f"bfloat16, {algorithm}: residuals {dtypes}, loss {losses}")
    if len(runs) == 4 and not all(
        torch.equal(a, b) for s, t in ((0, 2), (1, 3)) for a, b in zip(runs[s], runs[t])
    ):
        problems.append("bfloat16: the async hook's parameters differ from the sync hook's")
    return problems


def _one_state_two_models(torch, ddp_cls, comm) -> list[str]:
    """One state registered on two DDP models is not supported: their buckets replace each
    other's reducers at every iteration, and the warning says so (a refusal tried here took
    one model whose layers were frozen for one iteration for two models). One model whose
    parameters change, re-wrapped in a new DDP with the same state, trains on."""
    from sparsecoll.integrations.torch import (
        SparseHookState,
        async_sparse_allreduce_hook,
        sparse_allreduce_hook,
    )

    problems = []
    for hook in (sparse_allreduce_hook, async_sparse_allreduce_hook):
        torch.manual_seed(0)
        first, second = (ddp_cls(torch.nn.Linear(6, 3)) for _ in range(2))
        state = SparseHookState(comm, "allgather", density=0.25, warmup=1)
        for ddp in (first, second):
            ddp.register_comm_hook(state, hook)
        x = torch.randn(4, 6)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                for ddp in (first, second):
                    ddp(x).sum().backward()
        said = [str(w.message) for w in caught if "serves two DDP models" in str(w.message)]
        if len(said) < 3:
            problems.append(f"{hook.__name__}, one state for two models: warned {said}")

        # one model whose parameters change: the same module wrapped in a new DDP after
        # unfreezing its first layer, with the same state, trains on (the changed buckets
        # start afresh with a warning), also when frozen again for one iteration only
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
        state = SparseHookState(comm, "allgather", density=0.25)
        got = []
        for frozen, steps in ((True, 3), (False, 1), (True, 1), (False, 3)):
            module[0].requires_grad_(not frozen)
            ddp = ddp_cls(module)
            ddp.register_comm_hook(state, hook)
            for _ in range(steps):
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", RuntimeWarning)
                        ddp(x).sum().backward()
                    got.append("ok")
                except RuntimeError as exc:
                    got.append(str(exc))
        if got != ["ok"] * 8 or state.iteration != 8:
            problems.append(f"{hook.__name__}, a model re-wrapped: {got}, {state.iteration}")
    return problems


def _density_schedule(torch, ddp_cls, comm) -> list[str]:
    """state.density set between iterations (5% -> 30%) with the asynchronous hook: every
    bucket's reducer takes the new k, and error feedback loses nothing across the change
    (before, the new density was ignored). The state's own bookkeeping:
    tests/mpi/test_reducer.py."""
    import numpy as np

    from sparsecoll.integrations.torch import SparseHookState, async_sparse_allreduce_hook

    ledger = _Ledger(torch, ddp_cls, comm)
    state = SparseHookState(comm, "allgather", density=0.05)
    model, ddp, order = ledger.build(state, hook=async_sparse_allreduce_hook, bucket_cap_mb=1e-4)
    acc = [np.zeros(p.numel()) for p in model.parameters()]
    ledger.run(model, ddp, 3, acc)
    state.density = 0.3
    ledger.run(model, ddp, 3, acc)
    ks = [(red.k, round(0.3 * red.n)) for red in state.reducers.values()]
    err = ledger.lost(model, state, order, acc, 6)
    if len(ks) < 2 or any(k != want for k, want in ks) or err > 1e-5:
        return [f"density 0.05 -> 0.3: (k, wanted) {ks}, gradients off by {err:.3g}"]
    return []


def _branch_unused_everywhere(torch, ddp_cls, comm) -> list[str]:
    """find_unused_parameters=True, a branch that no rank uses in one iteration: with
    gradient_as_bucket_view=True and zero_grad(set_to_none=False) the gradients are views
    of the bucket, so the hook's update for the unused branch (residual entries it sent)
    is applied, and error feedback loses nothing: Σ p.grad · P + residual == Σ gradients
    (docs/guide/pytorch.md: otherwise DDP leaves such a gradient untouched, and what the hook
    sent for it is lost)."""
    import numpy as np

    from sparsecoll.integrations.torch import SparseHookState, sparse_allreduce_hook

    torch.manual_seed(0)
    model = torch.nn.ModuleList([torch.nn.Linear(7, 13), torch.nn.Linear(13, 3)])
    model.append(torch.nn.Linear(13, 3))  # the branch
    ddp = ddp_cls(model, find_unused_parameters=True, gradient_as_bucket_view=True)
    state, params, order = SparseHookState(comm, "allgather", density=0.1), [], []

    def recording(state, bucket):  # (the bucket's parameters, in bucket order)
        order[:] = [next(i for i, p in enumerate(params) if p is q) for q in bucket.parameters()]
        return sparse_allreduce_hook(state, bucket)

    ddp.register_comm_hook(state, recording)
    x = torch.randn(16, 7, generator=torch.Generator().manual_seed(comm.Get_rank()))
    params += model.parameters()

    def loss(branch):
        h = torch.tanh(model[0](x))
        return (model[1](h) + (model[2](h) if branch else 0)).pow(2).mean()

    applied = fed = 0.0
    for t in range(5):
        grads = torch.autograd.grad(loss(t != 3), params, allow_unused=True)
        fed += torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                          for g, p in zip(grads, params)]).double().numpy()  # fmt: skip
        ddp.zero_grad(set_to_none=False)
        ddp.module.forward = lambda t=t: loss(t != 3)  # (ModuleList has no forward)
        ddp().backward()
        applied += torch.cat([p.grad.reshape(-1) for p in params]).double().numpy()
    (bucket,) = state.reducers.values()
    res, off, residual = np.asarray(bucket.residual, dtype=np.float64), 0, [None] * len(params)
    for i in order:
        residual[i] = res[off : off + params[i].numel()]
        off += params[i].numel()
    lost = applied * comm.Get_size() + comm.allreduce(np.concatenate(residual))
    err = float(np.abs(lost - comm.allreduce(fed)).max())
    return [f"a branch unused everywhere: gradients off by {err:.3g}"] if err > 1e-5 else []


def _sparse_gradients(torch, ddp_cls, comm) -> list[str]:
    """nn.Embedding(sparse=True): DDP gives its sparse COO gradient a bucket of its own, and
    both hooks reduce it as its dense gradient and hand the update back sparse (before,
    its bucket raised on every rank, 'numpy cannot take a torch.float32 tensor of layout
    sparse_coo', with advice for allreduce's inputs that a DDP user cannot follow). At
    density 1.0 the parameters are those of DDP's default hook; at 0.1 error feedback loses
    nothing on the embedding: Σ p.grad · P + Σ residuals == Σ gradients (lr 0, one batch)."""
    import numpy as np

    from sparsecoll.integrations.torch import (
        SparseHookState,
        async_sparse_allreduce_hook,
        sparse_allreduce_hook,
    )

    rank, nn = comm.Get_rank(), torch.nn
    ids = torch.tensor([1, 2, 2, rank + 5, 9])  # (a repeated row: duplicate indices)

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(12, 3, sparse=True), nn.Linear(3, 2))

    def train(hook, density, lr, steps=4):
        model = build()
        ddp = ddp_cls(model)
        state = SparseHookState(comm, "allgather", density=density)
        if hook is not None:
            ddp.register_comm_hook(state, hook)
        opt, applied = torch.optim.SGD(model.parameters(), lr=lr), 0.0
        for _ in range(steps):
            opt.zero_grad()
            ddp(ids).pow(2).sum().backward()
            applied += model[0].weight.grad.to_dense().double().reshape(-1).numpy()
            opt.step()
        return model, state, applied

    problems, plain = [], build()
    plain(ids).pow(2).sum().backward()  # (this rank's gradient: every iteration's at lr 0)
    fed = comm.allreduce(plain[0].weight.grad.to_dense().double().reshape(-1).numpy()) * 4
    base, _, _ = train(None, 1.0, 0.1)
    for hook in (sparse_allreduce_hook, async_sparse_allreduce_hook):
        what = f"{hook.__name__}, nn.Embedding(sparse=True)"
        try:
            model, _, _ = train(hook, 1.0, 0.1)
            layout = model[0].weight.grad.layout
            same = all(
                torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                for a, b in zip(base.parameters(), model.parameters())
            )
            if layout != torch.sparse_coo or not same:
                problems.append(f"{what}: density 1.0 gives {layout}, default hook's: {same}")
            _, state, applied = train(hook, 0.1, 0.0)
            (red,) = [r for r in state.reducers.values() if r.n == 36]  # (the embedding's)
            got = applied * comm.Get_size() + comm.allreduce(np.asarray(red.residual, float))
            if (err := float(np.abs(got - fed).max())) > 1e-5:
                problems.append(f"{what}, density 0.1: gradients off by {err:.3g}")
        except Exception as exc:
            problems.append(f"{what}: {exc!r:.300}")
    return problems


def _warm_up_is_watched(torch, ddp_cls, comm) -> list[str]:
    """With the watchdog on, the synchronous hook's dense warm-up is watched as its steps
    are (a blocking call on the state's communicator, numbered among the engine's calls):
    before, it ran unwatched, and a rank that skipped a warm-up iteration left the others
    waiting for ever under SPARSECOLL_TIMEOUT (scratch hookwd.py: no diagnostic, no abort)."""
    import sparsecoll
    from sparsecoll.integrations.torch import SparseHookState, sparse_allreduce_hook

    mine = comm.Dup()  # (a progress engine of its own: the calls counted are this test's)
    before = sparsecoll.get_timeout()
    sparsecoll.set_timeout(600)
    try:
        ddp = ddp_cls(torch.nn.Linear(4, 2))
        ddp.register_comm_hook(
            SparseHookState(mine, "allgather", density=0.5), sparse_allreduce_hook
        )
        ddp(torch.ones(3, 4)).sum().backward()  # the warm-up iteration
        state = sparsecoll.Communicator(mine).engine().state()
    finally:
        sparsecoll.set_timeout(before)
    mine.Free()
    want = "idle after call #1 ddp bucket 0 (dense warm-up, iteration 0) (1 started, 1 completed)"
    return [] if state == want else [f"the warm-up with the watchdog on: engine {state!r}"]


def _worker() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    try:
        import numpy as np
        import torch
        from torch.nn.parallel import DistributedDataParallel

        import sparsecoll
        from sparsecoll.integrations.torch import (
            SparseHookState,
            async_sparse_allreduce_hook,
            init_process_group,
            sparse_allreduce_hook,
        )

        torch.set_num_threads(1)
        init_process_group(comm)
        rank = comm.Get_rank()
        problems = []

        base, base_losses = _train(torch, DistributedDataParallel, None, None, rank)
        state = SparseHookState(comm, "allgather", density=1.0)
        same, _ = _train(torch, DistributedDataParallel, state, sparse_allreduce_hook, rank)
        if not all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(base, same)):
            problems.append("density 1.0 differs from the default hook")
        if state.stats()["buckets"] < 2:
            problems.append(f"expected several buckets, got {state.stats()['buckets']}")

        # the overlapping hook: same updates as the synchronous one (2 dense warm-up
        # iterations, then sparse with error feedback)
        for name in ("allgather", "exdyna"):
            if name not in sparsecoll.available_algorithms():
                continue
            runs = []
            for hook in (sparse_allreduce_hook, async_sparse_allreduce_hook):
                state = SparseHookState(comm, name, density=0.1, warmup=2)
                runs.append(_train(torch, DistributedDataParallel, state, hook, rank, steps=8))
            (p_sync, l_sync), (p_async, l_async) = runs
            if l_sync != l_async or not all(torch.equal(a, b) for a, b in zip(p_sync, p_async)):
                problems.append(f"{name}: the async hook's updates differ from the sync hook's")

        # the hook is algorithm-agnostic (tests/mpi/test_reducer.py covers every algorithm):
        # one of each kind keeps this run short
        kinds = ("allgather", "gtopk", "oktopk", "exdyna")
        sparse = [a for a in kinds if a in sparsecoll.available_algorithms()]
        for name in sparse:
            state = SparseHookState(comm, name, density=0.1)
            params, losses = _train(
                torch, DistributedDataParallel, state, sparse_allreduce_hook, rank
            )
            if not losses[-1] < 0.8 * losses[0]:
                problems.append(f"{name}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
            flat = torch.cat([p.reshape(-1) for p in params]).numpy()
            other = comm.allgather(flat)
            if not all(np.array_equal(o, other[0]) for o in other):
                problems.append(f"{name}: parameters differ across ranks")
            st = state.stats()
            if not st["bytes_sent_last"] < st["dense_bytes_per_iteration"]:
                problems.append(f"{name}: sent {st['bytes_sent_last']} bytes, dense sends less")
        # a sub-communicator (here of one rank) unlike torch's world of 2 is not refused
        # (it may match a DDP process_group's subgroup): only MPI's whole world must match
        try:
            SparseHookState(MPI.COMM_SELF, "allgather", density=0.1)
        except RuntimeError as exc:
            problems.append(f"a sub-communicator's state was refused: {exc}")
        problems += _resume_into_fresh_ddp(torch, DistributedDataParallel, comm)
        problems += _skipped_iteration_loses_nothing(torch, DistributedDataParallel, comm)
        problems += _bfloat16_buckets(torch, DistributedDataParallel, comm)
        problems += _one_state_two_models(torch, DistributedDataParallel, comm)
        problems += _density_schedule(torch, DistributedDataParallel, comm)
        problems += _branch_unused_everywhere(torch, DistributedDataParallel, comm)
        problems += _warm_up_is_watched(torch, DistributedDataParallel, comm)
        problems += _sparse_gradients(torch, DistributedDataParallel, comm)

        # a reduction error (NaN on rank 0) reaches backward() on every rank with its type
        # and message (a future completed by set_exception gave "Unable to cast ... to
        # Tensor"), and training goes on (the batch skipped, as loss scaling does): the
        # synchronous hook raised inside DDP's autograd hook, and the next forward failed
        # DDP's internal assertion "!unmarked_param_indices.empty()"
        for hook in (sparse_allreduce_hook, async_sparse_allreduce_hook):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
            ddp = DistributedDataParallel(model)
            ddp.register_comm_hook(SparseHookState(comm, "allgather", density=0.1), hook)
            x = torch.randn(8, 8)
            ddp(x).pow(2).mean().backward()  # the warm-up iteration (dense)
            loss = ddp(x).pow(2).mean() * (float("nan") if rank == 0 else 1.0)
            try:
                loss.backward()
                got = "no error"
            except Exception as exc:
                got = f"{type(exc).__name__}: {exc}"
            if "NonFiniteError" not in got or "grad holds NaN or Inf" not in got:
                problems.append(f"{hook.__name__}: a NaN gradient gave {got[:300]!r}")
            try:
                for _ in range(2):
                    ddp.zero_grad()
                    ddp(x).pow(2).mean().backward()
                flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
                if not all(np.array_equal(o, flat) for o in comm.allgather(flat)):
                    problems.append(f"{hook.__name__}: gradients differ after a skipped batch")
            except Exception as exc:
                problems.append(f"{hook.__name__}: after a NaN batch: {exc!r:.300}")

            # nonfinite="nan": no error; the bucket comes back NaN on every rank, so that
            # GradScaler skips the step and halves its scale; the next steps train
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
            ddp = DistributedDataParallel(model)
            state = SparseHookState(comm, "allgather", density=0.1, nonfinite="nan")
            ddp.register_comm_hook(state, hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
            scales, moved = [], []
            try:
                for step in range(4):
                    opt.zero_grad()
                    bad = step == 2 and rank == 0  # after the warm-up iteration
                    loss = ddp(x).pow(2).mean() * (float("inf") if bad else 1.0)
                    scaler.scale(loss).backward()
                    before = [p.detach().clone() for p in model.parameters()]
                    scaler.step(opt)
                    scaler.update()
                    scales.append(scaler.get_scale())
                    moved.append(
                        any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
                    )
                red = next(iter(state.reducers.values()))
                ok = scales == [1024.0, 1024.0, 512.0, 512.0] and moved == [1, 1, 0, 1]
                ok = ok and red.steps == 2  # the skipped step changed no reducer
                if not ok:
                    problems.append(f"{hook.__name__} nan: scales {scales}, moved {moved}")
            except Exception as exc:
                problems.append(f"{hook.__name__} nonfinite='nan': {exc!r:.300}")
        every = comm.allgather(problems)
        bad = [f"rank {r}: {p}" for r, ps in enumerate(every) for p in ps]
        if bad:
            raise AssertionError("; ".join(bad))
        print(
            f"ddp hook ok (rank {rank}; default-hook loss {base_losses[0]:.3f} -> "
            f"{base_losses[-1]:.3f}; algorithms: {', '.join(sparse)})",
            flush=True,
        )
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        comm.Abort(1)


if __name__ == "__main__":
    _worker()


def test_the_warm_up_holds_the_communicator_from_check_to_allreduce(monkeypatch):
    """The warm-up's agreement and its dense allreduce belong together: another thread's
    call on the communicator between them would match their messages. Before, the lock was
    free between the two (each call took it alone)."""
    torch = pytest.importorskip("torch")
    import threading

    from mpi4py import MPI

    import sparsecoll.integrations.torch._hooks as hook_module
    from sparsecoll.integrations.torch import SparseHookState, sparse_allreduce_hook

    state = SparseHookState(MPI.COMM_SELF, algorithm="allgather", density=0.25, warmup=1)
    free = []
    check = hook_module.collective_check

    def watched_check(comm, *args, **kwargs):
        def other():  # (another thread: could it start a call now?)
            lock = comm.serial()
            got = lock.acquire(blocking=False)
            free.append(got)
            if got:
                lock.release()

        t = threading.Thread(target=other)
        t.start()
        t.join()
        return check(comm, *args, **kwargs)

    monkeypatch.setattr(hook_module, "collective_check", watched_check)
    grad = torch.arange(8.0)
    sparse_allreduce_hook(state, _Bucket(0, 1, grad, [torch.zeros(8)])).wait()
    assert free == [False]
    assert torch.equal(grad, torch.arange(8.0))  # (one rank: the mean is the bucket)


TORCHRUN_ENV = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}


@pytest.fixture
def no_launcher_env(monkeypatch):
    """No torch launcher's variables, nor MASTER_ADDR/MASTER_PORT, in the environment."""
    for var in (*TORCHRUN_ENV, "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.fixture
def rendezvous(no_launcher_env):
    """torch.distributed.init_process_group replaced by a recorder of its arguments."""
    pytest.importorskip("torch")
    import torch.distributed as dist

    calls = []
    no_launcher_env.setattr(dist, "init_process_group", lambda *a, **kw: calls.append(kw))
    return calls


@pytest.mark.parametrize(
    "env", [TORCHRUN_ENV, {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}], ids=["all", "local"]
)
def test_init_process_group_refuses_a_torchrun_environment(rendezvous, no_launcher_env, env):
    """Under torchrun (WORLD_SIZE=2, but each process an MPI world of one) the ranks got
    rank 0 of 1 from MPI and waited in torch's rendezvous until its timeout (probe:
    `torchrun --nproc_per_node 2 tr_sc_hang.py`); now refused before it, saying to use
    mpiexec. (This process is an MPI world of one, as under torchrun.)"""
    from sparsecoll.integrations.torch import init_process_group

    for var, value in env.items():
        no_launcher_env.setenv(var, value)
    with pytest.raises(RuntimeError, match=r"LOCAL_WORLD_SIZE=2.*mpiexec -n N.*\(rank 0\)"):
        init_process_group()
    assert rendezvous == []


def test_init_process_group_honours_master_port(rendezvous, no_launcher_env):
    """MASTER_PORT is the rendezvous port (as MASTER_ADDR is its address; before, a free
    port was always picked); `port=` comes first; a MASTER_PORT that is no port is refused
    naming it. A launcher's variables that agree with MPI (one process of one) pass."""
    from sparsecoll.integrations.torch import init_process_group

    no_launcher_env.setenv("MASTER_PORT", "29517")
    no_launcher_env.setenv("WORLD_SIZE", "1")
    no_launcher_env.setenv("RANK", "0")
    init_process_group()
    init_process_group(port=29600)
    assert [c["init_method"] for c in rendezvous] == [
        "tcp://127.0.0.1:29517",
        "tcp://127.0.0.1:29600",
    ]
    assert [(c["rank"], c["world_size"]) for c in rendezvous] == [(0, 1)] * 2
    no_launcher_env.setenv("MASTER_PORT", "http")
    with pytest.raises(ValueError, match="MASTER_PORT must be a TCP port.*'http'"):
        init_process_group()


@pytest.fixture
def torch_world_of_two():
    """torch.distributed initialized with 2 ranks in this process (torch's in-process
    "fake" backend), while MPI's world is this one process: what torchrun makes."""
    pytest.importorskip("torch")
    import torch.distributed as dist

    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")

    def start(size: int = 2) -> None:
        dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=size)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def test_the_hook_refuses_a_torch_world_unlike_its_mpi_world(torch_world_of_two):
    """torch.distributed with 2 ranks, the hook's communicator MPI's whole world of one (as
    under torchrun): before, the hook averaged each rank's gradients with itself alone,
    and the ranks' parameters drifted apart without an error (probe: `torchrun
    --nproc_per_node 2 torchrun_user.py own`). Now refused at SparseHookState(), or at the
    first bucket when torch.distributed started after the state was built; a torch world
    of the MPI world's size, and no torch world at all, are fine."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from sparsecoll.integrations.torch import SparseHookState, sparse_allreduce_hook

    built = SparseHookState(MPI.COMM_WORLD, density=0.5)  # (torch.distributed not started)
    torch_world_of_two()
    for comm in (None, MPI.COMM_WORLD, MPI.COMM_SELF):  # (COMM_SELF spans this world)
        with pytest.raises(RuntimeError, match=r"torch.distributed has 2 ranks.*has 1.*mpiexec"):
            SparseHookState(comm, density=0.5)
    grad = torch.arange(4.0)
    future = sparse_allreduce_hook(built, _Bucket(0, 1, grad, [torch.zeros(4)]))
    with pytest.raises(RuntimeError, match="torch.distributed has 2 ranks"):
        future.wait()
    dist.destroy_process_group()
    torch_world_of_two(1)
    sparse_allreduce_hook(SparseHookState(density=0.5), _Bucket(0, 1, grad, [grad])).wait()


def test_a_state_built_from_a_process_group_needs_one_mpi_job(torch_world_of_two):
    """SparseHookState(process_group=...) without a communicator builds one of the group's
    processes from their MPI ranks, gathered over the group: processes that are not one
    MPI job (torchrun's: each MPI rank 0 of a world of one; here torch's fake backend, whose
    gather gives this process's rank twice) are refused before MPI_Comm_create_group;
    with MPI's world given, the launch check refuses it as before. (The check against the
    communicator, and a state built of a group's processes, run under mpiexec:
    tests/mpi/test_errors.py.)"""
    pytest.importorskip("torch")
    import torch.distributed as dist
    from mpi4py import MPI

    from sparsecoll.integrations.torch import SparseHookState

    with pytest.raises(RuntimeError, match="not initialized"):
        SparseHookState(process_group=object())
    torch_world_of_two()
    with pytest.raises(RuntimeError, match=r"not one MPI job \(.*\[0, 0\].*mpiexec"):
        SparseHookState(process_group=dist.group.WORLD)
    with pytest.raises(RuntimeError, match=r"torch.distributed has 2 ranks.*has 1.*on rank 0"):
        SparseHookState(MPI.COMM_WORLD, process_group=dist.group.WORLD)


def test_the_hook_takes_density_not_k():
    """SparseHookState(k=10) said "k = round(density·n) = 1 ... pass density=10/n", from
    the one-entry reducer it builds to check its options: now it says the hook takes a
    density, since its buckets differ in size."""
    pytest.importorskip("torch")
    from mpi4py import MPI

    from sparsecoll.integrations.torch import SparseHookState

    with pytest.raises(TypeError, match="takes density, not k: DDP's buckets differ") as info:
        SparseHookState(MPI.COMM_SELF, algorithm="exdyna", k=10)
    assert "= 1" not in str(info.value)


def test_the_state_algorithm_and_options_are_fixed():
    """state.algorithm = "exdyna" (or new options) after the reducers were built left them
    running the old ones while the watchdog named the new one, silently (scratch probe:
    allgather reducers after state.algorithm = "exdyna" and state.options = {"momentum":
    0.9}). Now refused, saying to build a new state; an in-place change of the options
    is refused too, and so is a new communicator. density, warmup and nonfinite may still
    be set."""
    torch = pytest.importorskip("torch")
    from mpi4py import MPI

    from sparsecoll.integrations.torch import SparseHookState, sparse_allreduce_hook

    state = SparseHookState(MPI.COMM_SELF, "allgather", density=0.25, momentum=0.5)
    grad = torch.arange(8.0)
    for _ in range(2):  # (the warm-up, then a step: the bucket's reducer is built)
        sparse_allreduce_hook(state, _Bucket(0, 1, grad.clone(), [grad])).wait()
    with pytest.raises(AttributeError, match="algorithm is fixed at construction.*'exdyna'"):
        state.algorithm = "exdyna"
    with pytest.raises(AttributeError, match="options is fixed at construction.*new Sparse"):
        state.options = {"momentum": 0.9}
    with pytest.raises(TypeError):
        state.options["momentum"] = 0.9
    # (the communicator too: the built reducers kept the old one while the warm-up and
    # rebuilt buckets took the new, and the ranks' updates differed: scratch p_comm.py)
    comm = state.comm
    with pytest.raises(AttributeError, match="comm is fixed at construction"):
        state.comm = MPI.COMM_WORLD
    with pytest.raises(AttributeError, match="process_group is fixed at construction"):
        state.process_group = object()
    (red,) = state.reducers.values()
    assert state.comm is comm and red.comm is comm and state.process_group is None
    assert (state.algorithm, dict(state.options)) == ("allgather", {"momentum": 0.5})
    assert (red.algorithm_name, red.momentum) == ("allgather", 0.5)
    state.density, state.warmup, state.nonfinite = 0.5, 1, "nan"
    sparse_allreduce_hook(state, _Bucket(0, 1, grad.clone(), [grad])).wait()
    assert state.reducers[0].k == 4
