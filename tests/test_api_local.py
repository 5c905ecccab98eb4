"""The public entry point on a single-process communicator (MPI.COMM_SELF), in-process."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import sparsecoll


@pytest.fixture(scope="module")
def self_comm():
    from mpi4py import MPI

    return MPI.COMM_SELF


def test_accepts_lists_and_returns_numpy(self_comm):
    out = sparsecoll.allreduce(self_comm, np.array([1.0, 2.0, 3.0]), [4, 1, 4], n=5)
    assert out.indices.tolist() == [1, 4] and out.values.tolist() == [2.0, 4.0]
    assert out.values.dtype == np.float64
    assert np.array_equal(out.to_dense(), [0, 2, 0, 0, 4])


def test_empty_input(self_comm):
    out = sparsecoll.allreduce(self_comm, np.zeros(0, np.float32), np.zeros(0, np.int64), n=3)
    assert out.nnz == 0 and out.values.dtype == np.float32


def test_communicator_wrapper_keeps_stats(self_comm):
    c = sparsecoll.Communicator(self_comm)
    sparsecoll.allreduce(c, np.ones(3, np.float32), np.arange(3), n=3, algorithm="dense")
    assert c.last_stats.bytes_sent == 0  # one rank moves nothing


def test_rejects_non_communicator():
    with pytest.raises(TypeError, match="Intracomm"):
        sparsecoll.allreduce(object(), np.ones(1), np.zeros(1, np.int64), n=1)


def test_rejects_comm_null_saying_so(self_comm):
    from mpi4py import MPI

    # what Split(MPI.UNDEFINED) hands the ranks left out
    null = self_comm.Split(MPI.UNDEFINED, 0)
    with pytest.raises(TypeError, match="COMM_NULL: this rank is not in the communicator"):
        sparsecoll.allreduce(null, np.ones(1), np.zeros(1, np.int64), n=1)


def test_options_with_instance_rejected(self_comm):
    algo = sparsecoll.get_algorithm("allgather")
    with pytest.raises(sparsecoll.CollectiveTypeError, match="options go to get_algorithm"):
        sparsecoll.allreduce(self_comm, np.ones(1), np.zeros(1, np.int64), n=1, algorithm=algo, k=1)


def test_torch_cpu_tensors_round_trip(self_comm):
    torch = pytest.importorskip("torch")
    vals = torch.tensor([1.0, 2.0], dtype=torch.float32)
    idx = torch.tensor([3, 3])
    out = sparsecoll.allreduce(self_comm, vals, idx, n=4)
    assert isinstance(out.values, torch.Tensor)
    assert out.indices.tolist() == [3] and out.values.tolist() == [3.0]


def test_polling_wait_schedule(monkeypatch):
    """The polling wait: a short spin, then sleeps of a fraction of the time waited so far,
    within [POLL_MIN, POLL_MAX]; it returns the test's first true value (on a fake clock)."""
    from sparsecoll import _polling as C

    clock = {"t": 100.0}
    sleeps: list[tuple[float, float]] = []  # (waited before the sleep, its length)
    monkeypatch.setattr(C.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(C, "_yield", lambda: clock.update(t=clock["t"] + 1e-6))

    def sleep(s):
        sleeps.append((clock["t"] - 100.0, s))
        clock["t"] += s

    monkeypatch.setattr(C.time, "sleep", sleep)
    done_at = 2.0  # seconds of fake time until the "request" completes
    assert C.poll(lambda: clock["t"] - 100.0 >= done_at and "flag") == "flag"
    waited = clock["t"] - 100.0
    assert done_at <= waited <= done_at * (1 + C.POLL_FRACTION) + C.POLL_MAX
    assert sleeps and sleeps[0][0] >= C.POLL_SPIN  # no sleep during the spin
    for before, s in sleeps:
        assert C.POLL_MIN <= s <= C.POLL_MAX
        assert s == C.POLL_MIN or s == C.POLL_MAX or s == pytest.approx(before * C.POLL_FRACTION)
    assert sleeps[-1][1] == C.POLL_MAX  # a long wait tests about once per POLL_MAX
    assert len(sleeps) < 2 * done_at / C.POLL_MAX + 200
    assert C.poll(lambda: 7) == 7  # done at once: no sleep


@pytest.mark.parametrize("version", ["3.1.6", "3.2.0.dev0", "4.0.0", "4.1.2", "10.0", "?"])
@pytest.mark.parametrize("library", [True, False])
def test_large_counts_need_mpi4py_4_and_the_library(monkeypatch, version, library):
    """Counts past COUNT_MAX go in one call only when mpi4py >= 4 (which routes them to
    MPI's ``_c`` calls) and the MPI library has those calls; mpi4py 3 (pyproject allows
    >= 3.1) got no split when the library had them."""
    import ctypes
    import types

    import mpi4py
    from mpi4py import MPI  # noqa: F401  (loaded first: loading looks the library up with CDLL)

    from sparsecoll import _mpilib as C

    calls = {"MPI_Allgatherv_c": ctypes.pythonapi} if library else {}
    monkeypatch.setattr(mpi4py, "__version__", version)
    monkeypatch.setattr(C.ctypes, "CDLL", lambda *a, **k: types.SimpleNamespace(**calls))
    C.large_counts.cache_clear()
    try:
        got = C.large_counts()
    finally:
        monkeypatch.undo()
        C.large_counts.cache_clear()  # (the real answer, for later tests)
    assert got == (library and version[0].isdigit() and int(version.split(".")[0]) >= 4)


@pytest.mark.parametrize("algorithm", ["allgather", "gtopk", "oktopk"])
def test_fewer_nonzeros_than_k_needs_no_exact_topk(self_comm, monkeypatch, algorithm):
    """A gradient with fewer than k nonzeros (an embedding's: a few rows per step) sends all
    of them; after the first such step the pass collects every nonzero, so the reducer
    runs no exact top-k over the whole vector until the nonzeros outgrow k."""
    from sparsecoll import select
    from sparsecoll.training import GradientReducer

    n, d = 4000, 40  # 100 rows of 40; k = 400: 2 rows per step leave 80 nonzeros
    red = GradientReducer(self_comm, n, algorithm, 0.1, error_feedback=False)
    calls = []
    real = select.topk
    monkeypatch.setattr(select, "topk", lambda x, k: calls.append(k) or real(x, k))
    rng = np.random.default_rng(0)
    for step in range(6):
        g = np.zeros(n, np.float32)
        for row in rng.choice(100, 2, replace=False):
            g[row * d : (row + 1) * d] = rng.standard_normal(d)
        assert np.array_equal(red.step(g), g)  # P = 1, no error feedback: all nonzeros
        assert len(calls) == 1, step  # the first step's only
    g = rng.standard_normal(n).astype(np.float32)  # now more than k nonzeros: the top k
    u = red.step(g)
    keep = np.argsort(-np.abs(g), kind="stable")[: red.k]
    assert np.array_equal(np.flatnonzero(u), np.sort(keep)) and np.array_equal(u[keep], g[keep])


def test_reused_update_survives_an_algorithm_returning_its_input(self_comm):
    """reuse_update keeps the last result's indices for the next step's O(k) zeroing. A
    registered algorithm may return its input as is (at P = 1 the sum is the input), and
    with the reuse selection the input's indices are the pass's hits, in the workspace that
    the next pass overwrites: the reducer keeps a copy, so the updates equal fresh ones."""
    from sparsecoll import Algorithm, GradientReducer, register_algorithm
    from sparsecoll.registry import _REGISTRY

    class Identity(Algorithm):
        name = "test-identity"

        def reduce(self, comm, x):
            return x

    register_algorithm(Identity)
    try:
        kw = dict(selection="reuse", selection_options={"interval": 3})
        reuse = GradientReducer(self_comm, 3000, "test-identity", 0.02, reuse_update=True, **kw)
        fresh = GradientReducer(self_comm, 3000, "test-identity", 0.02, **kw)
        for t in range(6):
            g = np.random.default_rng(t).standard_normal(3000)
            np.testing.assert_array_equal(reuse.step(g), fresh.step(g), err_msg=f"step {t}")
    finally:
        _REGISTRY.pop("test-identity", None)


@pytest.mark.parametrize("algorithm", ["oktopk", "exdyna", "gtopk"])
def test_reducer_rejects_k_beside_density(self_comm, algorithm):
    """k is set from density; a k= among the algorithm options used to override the
    algorithm's k silently while the local selection and stats() kept density's."""
    from sparsecoll.training import GradientReducer

    with pytest.raises(TypeError, match=r"sets k from density .* = 10\); pass density=50/n"):
        GradientReducer(self_comm, 1000, algorithm, 0.01, k=50)


def test_training_defaults_to_oktopk(self_comm):
    """The reducer and the DDP hook's state default to oktopk, the README's recommendation
    for training (volume per rank near 2k(P-1)/P, not allgather's up to P·k entries)."""
    from sparsecoll.integrations.torch import SparseHookState  # (builds without torch)
    from sparsecoll.training import GradientReducer

    assert GradientReducer(self_comm, 100).algorithm_name == "oktopk"
    assert sparsecoll.GradientReducer is GradientReducer
    assert SparseHookState(self_comm).algorithm == "oktopk"


def test_allreduce_takes_big_endian_values_and_returns_native(self_comm):
    """MPI moves raw bytes: non-native input is converted, not refused as "not float32"."""
    for dtype in (">f2", ">f4", ">f8"):
        vals = np.array([1.5, -2.0, 4.0], dtype)
        out = sparsecoll.allreduce(self_comm, vals, np.array([3, 0, 3], ">i4"), n=4)
        assert out.values.dtype == np.dtype(dtype).newbyteorder("=")
        assert out.to_dense().tolist() == [-2.0, 0.0, 0.0, 5.5]


def test_torch_result_to_dense(self_comm):
    """A result of torch input holds torch tensors; to_dense gives a torch tensor (it asked
    numpy for a zeros array of torch.float32)."""
    torch = pytest.importorskip("torch")
    out = sparsecoll.allreduce(self_comm, torch.ones(3), torch.tensor([0, 2, 2]), n=4)
    dense = out.to_dense()
    assert isinstance(dense, torch.Tensor) and dense.tolist() == [1.0, 0.0, 2.0, 0.0]


@pytest.mark.parametrize("call", ["to_dense", "Communicator.allreduce", "GradientReducer.step"])
def test_a_torch_out_written_is_seen_by_autograd(self_comm, call):
    """A torch tensor given as ``out`` is written through a numpy view: its version counter
    is raised, as torch's own in-place writes raise it, so a tensor that autograd saved
    for backward makes backward() raise instead of giving gradients of the new values
    (w.grad was [7, 7, 7] for w * x, x written with 7s after the product, silently)."""
    torch = pytest.importorskip("torch")
    w = torch.ones(3, requires_grad=True)
    x = torch.ones(3)
    loss = (w * x).sum()  # (saves x: d loss / d w = x)
    if call == "to_dense":
        sparsecoll.SparseVector.from_coo([0, 1, 2], np.full(3, 7.0, np.float32), 3).to_dense(out=x)
    elif call == "Communicator.allreduce":
        sparsecoll.Communicator(self_comm).allreduce(np.full(3, 7.0, np.float32), out=x)
    else:
        reducer = sparsecoll.GradientReducer(self_comm, n=3, algorithm="allgather", density=1.0)
        reducer.step(np.full(3, 7.0, np.float32), out=x)
    assert x.tolist() == [7.0] * 3
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_communicator_allreduce_takes_array_likes(self_comm):
    """Communicator.allreduce takes what allreduce does (a list was an AttributeError, a
    torch tensor or big-endian array "not float32"); torch in, torch out."""
    c = sparsecoll.Communicator(self_comm)
    assert c.allreduce([1.0, 2.0]).tolist() == [1.0, 2.0]
    got = c.allreduce(np.array([1.0, 2.0], ">f4"))
    assert got.dtype == np.float32 and got.tolist() == [1.0, 2.0]
    torch = pytest.importorskip("torch")
    t = torch.ones(3)
    assert isinstance(c.allreduce(t), torch.Tensor)
    assert c.allreduce(t, out=t) is t and t.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("bad", ["list", "read-only", "masked"])
def test_communicator_allreduce_refuses_outs_it_cannot_write(self_comm, bad):
    """A list out was summed into a copy and lost; a read-only out raised numpy's bare
    "assignment destination is read-only" (on one rank, after the others had started)."""
    c = sparsecoll.Communicator(self_comm)
    buf = np.ones(3)
    if bad == "list":
        out, err, text = [0.0] * 3, TypeError, "out must be an array written in place"
    elif bad == "read-only":
        out, err, text = np.frombuffer(bytes(24)), ValueError, "out must be a contiguous, writeable"
    else:
        out = np.ma.masked_array(np.zeros(3), mask=[0, 1, 0])
        err, text = TypeError, "out: a masked array with 1 of 3 entries masked"
    with pytest.raises(err, match=text):
        c.allreduce(buf, out=out)
    with pytest.raises(TypeError, match="buf: a masked array"):
        c.allreduce(np.ma.masked_array(buf, mask=[1, 0, 0]))


def test_reducer_step_representations(self_comm):
    """GradientReducer.step: a big-endian grad equals the native one (it was refused as
    "not float32"); an out numpy can only copy (a list) is refused (the update went into a
    copy and the caller's list came back unchanged); masked grad entries are refused."""
    from sparsecoll import GradientReducer

    g = np.arange(6, dtype=np.float32)
    want = GradientReducer(self_comm, 6, "allgather", 0.5).step(g)
    got = GradientReducer(self_comm, 6, "allgather", 0.5).step(g.astype(">f4"))
    assert got.dtype == np.float32 and np.array_equal(got, want)
    red = GradientReducer(self_comm, 6, "allgather", 0.5)
    with pytest.raises(sparsecoll.CollectiveTypeError, match="out must be an array written"):
        red.step(g, out=[0.0] * 6)
    with pytest.raises(sparsecoll.CollectiveTypeError, match="grad: a masked array with 2"):
        red.step(np.ma.masked_array(g, mask=[0, 1, 0, 0, 0, 1]))
    assert np.array_equal(red.step(g), want)  # nothing changed by the refused steps


def test_empty_list_of_indices(self_comm):
    """A rank with nothing to send may pass [] (numpy makes it float64, and indexing with
    ``x[[]]`` takes it too); it was refused as "indices must be integers, got float64". So
    may an empty range (a rank's empty slice, range(lo, lo)), where a range of entries was
    taken: numpy makes range(0) float64 too."""
    for empty in ([], (), range(0), range(7, 7)):
        out = sparsecoll.allreduce(self_comm, np.zeros(0, np.float32), empty, n=3)
        assert out.nnz == 0 and out.values.dtype == np.float32
        assert sparsecoll.SparseVector.from_coo(empty, np.zeros(0), 3).nnz == 0
    with pytest.raises(sparsecoll.CollectiveTypeError, match="integers, got float64"):
        sparsecoll.allreduce(self_comm, np.zeros(0), np.zeros(0), n=3)  # an array says so


@pytest.mark.parametrize("numpy2", [True, False])
def test_output_buffers_are_never_copies(monkeypatch, numpy2):
    """An output buffer is viewed, never copied (writes to a copy would be lost): a list is
    refused, arrays and writable buffers are taken as they are, also on numpy 1.x's path
    (no ``copy=False`` meaning "never" there; pyproject allows numpy >= 1.24)."""
    from sparsecoll import _array

    if numpy2 and int(np.__version__.split(".")[0]) < 2:  # (no copy= in numpy 1.x's asarray)
        pytest.skip("numpy 2's path needs numpy 2")
    monkeypatch.setattr(_array, "_NUMPY2", numpy2)
    buf = bytearray(8)
    view, _ = _array.as_array(memoryview(buf), "out", writable=True)
    view[:] = 7
    assert bytes(buf) == bytes([7] * 8)
    a = np.zeros(3)
    assert _array.as_array(a, "out", writable=True)[0] is a
    with pytest.raises(TypeError, match="out must be an array written in place, got a list"):
        _array.as_array([0.0, 0.0], "out", writable=True)


def test_swapped_values_and_indices_say_so(self_comm):
    """allreduce takes (values, indices), SparseVector.from_coo (indices, values): an
    integer ``values`` next to float ``indices`` names the likely swap."""
    vals, idx = np.array([1.0, 2.0], np.float32), np.array([3, 1])
    with pytest.raises(
        sparsecoll.CollectiveTypeError, match=r"got int64 \(and indices are floats: swapped\?"
    ):
        sparsecoll.allreduce(self_comm, idx, vals, n=5)
    with pytest.raises(TypeError, match="swapped"):
        sparsecoll.SparseVector.from_coo(vals, idx, 5)
    with pytest.raises(sparsecoll.CollectiveTypeError) as err:  # integers, but no swap
        sparsecoll.allreduce(self_comm, idx, idx, n=5)
    assert "swapped" not in str(err.value)


def test_an_algorithm_class_instead_of_an_instance(self_comm):
    cls = sparsecoll.get_algorithm("gtopk", k=1).__class__
    with pytest.raises(
        sparsecoll.CollectiveTypeError, match=r"got the class \w+ \(pass an instance"
    ):
        sparsecoll.allreduce(self_comm, [1.0], [0], n=2, algorithm=cls)


AFTER_FINALIZE = """
import numpy as np
from mpi4py import MPI
import sparsecoll
c = sparsecoll.Communicator()
red = sparsecoll.GradientReducer(c, n=4, density=0.5)
args = (np.ones(2), [0, 3])
MPI.Finalize()
for name, call in [
    ("allreduce", lambda: sparsecoll.allreduce(MPI.COMM_WORLD, *args, n=4)),
    ("allreduce(Communicator)", lambda: sparsecoll.allreduce(c, *args, n=4)),
    ("iallreduce", lambda: sparsecoll.iallreduce(c, *args, n=4)),
    ("step", lambda: red.step(np.ones(4))),
    ("step_async", lambda: red.step_async(np.ones(4))),
    ("GradientReducer", lambda: sparsecoll.GradientReducer(None, n=4)),
    ("Communicator.allreduce", lambda: c.allreduce(np.ones(3))),
]:
    try:
        call()
    except RuntimeError as exc:
        print(name, "raised:", exc, flush=True)
"""
BEFORE_INIT = """
import mpi4py
mpi4py.rc.initialize = False
from mpi4py import MPI
import sparsecoll
try:
    sparsecoll.allreduce(MPI.COMM_WORLD, [1.0], [0], n=2)
except RuntimeError as exc:
    print("allreduce raised:", exc, flush=True)
"""


def test_calls_after_finalize_or_before_init_raise():
    """After MPI.Finalize() (or before MPI is initialized) every entry point raises
    RuntimeError: its first MPI call ended the process (MPICH: "Attempting to use an MPI
    routine (internal_Comm_rank) before initializing or after finalizing MPICH", no
    traceback, nothing after it ran)."""
    calls = ["allreduce", "allreduce(Communicator)", "iallreduce", "step", "step_async"]
    calls += ["GradientReducer", "Communicator.allreduce"]
    for code, want, names in [
        (AFTER_FINALIZE, "MPI is finalized", calls),
        (BEFORE_INIT, "MPI is not initialized", ["allreduce"]),
    ]:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
        lines = out.stdout.splitlines()
        assert [line.split(" raised: ")[0] for line in lines] == names, out.stdout + out.stderr
        assert all(want in line for line in lines), out.stdout


def test_no_mpi_library_is_named_with_what_to_install():
    """With mpi4py but no MPI library it can load (a venv without the mpi extra and no site
    MPI), sparsecoll's first MPI call says what to install; it raised mpi4py's bare
    "RuntimeError: cannot load MPI library" and the paths it tried."""
    code = (
        "import numpy as np, sparsecoll\n"
        "try:\n"
        "    sparsecoll.allreduce(None, np.ones(2, np.float32), np.arange(2), n=4)\n"
        "except RuntimeError as exc:\n"
        "    print(exc)\n"
        "else:\n"
        "    print('loaded')\n"
    )
    env = dict(os.environ, MPI4PY_LIBMPI="/nonexistent/libmpi.so")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    if out.stdout.strip() == "loaded":  # (an mpi4py built for one MPI: no loader to mislead)
        pytest.skip("this mpi4py does not read MPI4PY_LIBMPI")
    assert "pip install 'sparsecoll[mpi]' installs MPICH" in out.stdout, out.stdout + out.stderr
    assert "/nonexistent/libmpi.so" in out.stdout  # (mpi4py's detail kept)


@pytest.mark.parametrize(
    "var", ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS"]
)
def test_another_mpis_launcher_is_refused_not_p_jobs_of_one(var):
    """Another MPI's mpiexec in front of mpi4py's MPI starts P processes that each run as a
    world of one: allreduce returned every rank's own input, unreduced, with no error (P
    copies of a job of one). The launcher's variables, as it sets them, make it refused
    (srun's: as a task srun started itself, SLURM_TASK_PID its pid; it ran, as MVAPICH's)."""
    code = (
        "import numpy as np, sparsecoll\n"
        "for make in (\n"
        "    lambda: sparsecoll.allreduce(None, np.ones(2, np.float32), np.arange(2), n=4),\n"
        "    lambda: sparsecoll.GradientReducer(None, n=4, density=0.5),\n"
        "):\n"
        "    try:\n"
        "        make()\n"
        "    except RuntimeError as exc:\n"
        "        print(exc)\n"
        "    else:\n"
        "        print('ran')\n"
    )
    launchers = ("PMI_", "OMPI_", "MV2_", "SLURM_")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(launchers)}
    # (exec: python is the process whose pid the shell gives it, as srun's task is)
    task = ["sh", "-c", 'SLURM_TASK_PID=$$ exec "$0" -c "$1"', sys.executable, code]
    for env, want in ((clean, ["ran", "ran"]), ({**clean, var: "2"}, None)):
        out = subprocess.run(task, env=env, capture_output=True, text=True, timeout=120)
        lines = out.stdout.splitlines()
        assert out.returncode == 0 and len(lines) == 2, out.stdout + out.stderr
        if want:
            assert lines == want
            continue
        srun = var.startswith("SLURM_")
        started = "srun started 2 tasks" if srun else "the launcher started 2 processes"
        for line in lines:
            assert line.startswith(f"sparsecoll: {started} ({var}=2)"), line
            assert f"unset {var}" in line, line
            assert ("--mpi= plugin" if srun else "another MPI's than mpi4py's") in line, line


def test_import_is_light():
    """``import sparsecoll`` loads neither MPI nor Numba (nor torch, CuPy): they come with
    the first call that needs them, so a script's --help or a worker that never calls stays
    quick (mpi4py initializes MPI when imported)."""
    code = "import sys, sparsecoll; print(sorted(m for m in {!r} if m in sys.modules))"
    heavy = ["cupy", "mpi4py", "numba", "torch"]
    out = subprocess.run(
        [sys.executable, "-c", code.format(heavy)], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
