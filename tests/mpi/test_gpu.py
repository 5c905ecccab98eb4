"""Device buffers end to end under MPI: every algorithm, the Communicator's device paths,
NCCLCommunicator, collective errors.

Each test runs on two device modules: ``fake`` (tests/fakecupy.py, always: a strict
numpy-backed CuPy, so host/device mixing, staging and the CUDA-aware hand-off are checked
in CI) and ``cupy`` (a real GPU; skipped cleanly without one; ranks share the GPUs
round-robin, so several ranks on one GPU exercise the pinned-host staging). The CUDA-aware
mode (device pointers handed to MPI) runs on the fake always (its memory is host memory)
and on a real GPU only when the MPI library says it is CUDA-aware.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import sparsecoll
from sparsecoll import CollectiveInputError, CollectiveTypeError, Communicator
from sparsecoll._array import cupy_or_none, index_dtype
from sparsecoll._mpilib import query_cuda_aware
from sparsecoll.registry import algorithm_class

from .. import fakecupy
from .cases import assert_all, assert_identical, cases, local_input, mismatch

ALGORITHMS = sparsecoll.available_algorithms()
# one algorithm per way of driving the Communicator (dense allreduce, allgatherv,
# point-to-point, selecting with contribution masks, dense-input sparsifier): the tests of
# components *around* the algorithms use these, to keep the oversubscribed MPI time down
REPRESENTATIVE = [
    a for a in ("dense", "allgather", "dsa", "gtopk", "oktopk", "exdyna") if a in ALGORITHMS
]


def _real_cupy(comm):
    """Real CuPy with a device on every rank, or a collective skip."""
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        count = 0
    counts = comm.allgather_object(count)
    if min(counts) < 1:
        pytest.skip("no CUDA device (and CuPy) on every rank")
    cupy.cuda.Device(comm.rank % count).use()
    cupy_or_none.cache_clear()
    return cupy


@pytest.fixture(scope="module", params=["fake", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request, comm):
    if request.param == "fake":
        with fakecupy.installed() as fake:
            yield fake
    else:
        yield _real_cupy(comm)


def _modes(xp, comm) -> list[bool]:
    """The CUDA-aware settings to try: both on the fake, only a safe one on a real GPU."""
    if xp is fakecupy.module:
        return [False, True]
    return [query_cuda_aware(comm.mpi_comm)]


def _host(a):
    return a if isinstance(a, np.ndarray) else a.get()


def _run(c, cls, vals, idx, n, k):
    options = cls.default_options(n, k)
    if cls.name == "auto":  # (fixed constants: the same pick for host and device arrays)
        options.update(alpha=5e-6, beta=1e-10)
    return sparsecoll.allreduce(c, vals, idx, n=n, algorithm=cls(**options))


def _differs(dev, host, exact_case=None, size=None) -> str | None:
    """Why the device result ``dev`` is not the host result (or, for an exact algorithm,
    the oracle's sum of ``exact_case``); None when it is."""
    hi, hv = _host(dev.indices), _host(dev.values)
    if exact_case is not None:
        return mismatch(sparsecoll.SparseVector(hi, hv, dev.n), exact_case, size)
    if not np.array_equal(hi, host.indices):
        return "selected indices differ from the host run"
    if not np.allclose(hv.astype(np.float64), host.values.astype(np.float64), rtol=1e-3):
        return "values differ from the host run"
    if dev.contributed is not None and not np.array_equal(
        _host(dev.contributed), _host(host.contributed)
    ):
        return "contributed mask differs from the host run"
    return None


ROW_ALGORITHMS = [a for a in ALGORITHMS if algorithm_class(a).takes_rows]


@given(name=st.sampled_from(ROW_ALGORITHMS), case=cases(max_n=5000, rows=True))
def test_rows_on_device(comm, xp, name, case):
    """Row values on the device (repeats coalesced there, merged, sent dense or sparse): the
    oracle's (n, D) sum, device out, identical on every rank."""
    vals, idx = local_input(case, comm.rank, comm.size)
    dev = sparsecoll.allreduce(comm, xp.asarray(vals), xp.asarray(idx), n=case.n, algorithm=name)
    if not isinstance(dev.values, xp.ndarray):
        why = f"result left the device: {type(dev.values)}"
    else:
        why = _differs(dev, None, case, comm.size)
    assert_all(comm, why is None, f"{name} rows: {why}")
    assert_identical(comm, sparsecoll.SparseVector(_host(dev.indices), _host(dev.values), dev.n))


@given(name=st.sampled_from(ALGORITHMS), case=cases(max_n=5000), aware=st.booleans())
def test_algorithm_on_device(comm, xp, name, case, aware):
    """Device in, device out; exact algorithms equal the oracle, selecting ones their host run.

    The algorithm is drawn with the case (every algorithm also runs at every P in the test
    below): parametrizing would multiply the oversubscribed MPI calls by the algorithm count.
    """
    cls = algorithm_class(name)
    modes = _modes(xp, comm)
    c = Communicator(comm.mpi_comm)
    c.cuda_aware = aware if aware in modes else modes[0]
    vals, idx = local_input(case, comm.rank, comm.size)
    k = max(1, round(case.density * case.n))
    dev = _run(c, cls, xp.asarray(vals), xp.asarray(idx), case.n, k)
    if not (isinstance(dev.values, xp.ndarray) and isinstance(dev.indices, xp.ndarray)):
        why = f"result left the device: {type(dev.values)}, {type(dev.indices)}"
    elif dev.indices.dtype != index_dtype(case.n) or str(dev.values.dtype) != case.dtype:
        why = f"dtypes {dev.indices.dtype}, {dev.values.dtype}"
    elif cls.exact:
        why = _differs(dev, None, case, comm.size)
    else:
        why = _differs(dev, _run(c, cls, vals, idx, case.n, k))
    assert_all(comm, why is None, f"{name}, cuda_aware={c.cuda_aware}: {why}")
    assert_identical(comm, sparsecoll.SparseVector(_host(dev.indices), _host(dev.values), dev.n))


@pytest.mark.parametrize("aware", [False, True], ids=["staged", "cuda_aware"])
def test_exdyna_widening_rederive_on_device(comm, xp, aware):
    """exdyna's re-derive with a partition holding more than its share of the large values
    (ranks widen: some send, some send nothing, in later rounds) gives the host's result."""
    from sparsecoll.algorithms.exdyna import ExDyna

    modes = _modes(xp, comm)
    n, k = 4096, 64
    rng = np.random.default_rng([17, comm.rank])
    acc = rng.standard_normal(n) * np.where(np.arange(n) < n // 8, 1e3, 1.0)
    c = Communicator(comm.mpi_comm)
    c.cuda_aware = aware if aware in modes else modes[0]
    dev = ExDyna(k=k).reduce_dense(c, xp.asarray(acc))
    host = ExDyna(k=k).reduce_dense(c, acc)
    why = _differs(dev, host)
    assert_all(comm, why is None and host.nnz == k, f"cuda_aware={c.cuda_aware}: {why}")


def test_float32_subnormals_on_device_as_on_host(comm, xp):
    """Every algorithm on float32 subnormals gives the host's result bit for bit. CuPy's own
    comparisons, nonzero tests and abs read float32 subnormals as 0 (its -ftz=true; the
    fake does too): gtopk, oktopk and exdyna selected nothing on the device, and dense,
    rabenseifner, recursive_doubling and dsa dropped them from a dense result. On the fake
    only: a GPU's float32 sums flush as well (docs/guide/gpu.md), which the fake does not model."""
    if xp is not fakecupy.module:
        pytest.skip("CuPy's float32 sums flush subnormals on a GPU (docs/guide/gpu.md)")
    tiny = np.finfo(np.float32).smallest_subnormal
    n, k = 400, 20
    rng = np.random.default_rng([23, comm.rank])
    idx = np.sort(rng.choice(n, 120, replace=False))
    vals = (rng.integers(-60, 61, 120) * tiny).astype(np.float32)
    c = Communicator(comm.mpi_comm)
    problems = []
    for name in ALGORITHMS:
        cls = algorithm_class(name)
        host = _run(c, cls, vals, idx, n, k)
        dev = _run(c, cls, xp.asarray(vals), xp.asarray(idx), n, k)
        hi, hv = _host(dev.indices), _host(dev.values)
        same = np.array_equal(hi, host.indices) and np.array_equal(
            hv.view(np.uint32), host.values.view(np.uint32)
        )
        if not same or host.nnz == 0:
            problems.append(f"{name}: {hi.shape[0]} entries on the device, {host.nnz} on the host")
    assert_all(comm, not problems, "; ".join(problems))


def test_oktopk_window_calls_on_subnormals_as_on_host(comm, xp):
    """An oktopk stream of float32 subnormals takes the same window calls on the device as
    on the host. At P = 1 with k entries (a caller's local top-k) the window keeps them all
    from their least |value|, which CuPy's abs and min read as 0 on a GPU: every window
    call missed there and fell back to the exact select (info["recomputed"])."""
    if xp is not fakecupy.module:
        pytest.skip("CuPy's float32 sums flush subnormals on a GPU (docs/guide/gpu.md)")
    from sparsecoll.algorithms.oktopk import OkTopk

    tiny = np.finfo(np.float32).smallest_subnormal
    n, k = 400, 20
    c = Communicator(comm.mpi_comm)
    host, dev = OkTopk(k=k, tau=8), OkTopk(k=k, tau=8)
    problems, windows = [], 0
    for step in range(4):
        rng = np.random.default_rng([29, step, comm.rank])
        idx = np.sort(rng.choice(n, k, replace=False))
        vals = (rng.integers(40, 61, k) * rng.choice([-1, 1], k) * tiny).astype(np.float32)
        h = sparsecoll.allreduce(c, vals, idx, n=n, algorithm=host)
        d = sparsecoll.allreduce(c, xp.asarray(vals), xp.asarray(idx), n=n, algorithm=dev)
        windows += h.info["window"] is not None
        got = (_host(d.indices), _host(d.values).view(np.uint32), d.info["window"])
        if not (
            np.array_equal(got[0], h.indices)
            and np.array_equal(got[1], h.values.view(np.uint32))
            and got[2] == h.info["window"]
        ):
            problems.append(f"call {step}: window {got[2]} on the device, {h.info['window']}")
    assert_all(comm, not problems and windows, "; ".join(problems) or "no window call")


def test_exdyna_nan_among_subnormals_raises_on_device_as_on_host(comm, xp):
    """exdyna's first call on a partition holding a NaN and float32 subnormals raises on
    every rank on the device as on the host. The derive's fallback (the selection kernels
    refuse the NaN) took CuPy's abs, which reads the subnormals as 0: with the NaN dropped
    too, nothing was sent, and the device call returned an empty result silently."""
    from sparsecoll.algorithms.exdyna import ExDyna

    tiny = np.finfo(np.float32).smallest_subnormal
    x = np.zeros(1000, np.float32)
    alg = ExDyna(k=5)
    alg.prepare(comm, x.shape[0])
    lo = alg.owned_range(comm.rank)[0]
    x[lo : lo + 4] = np.array([np.nan, 3, -5, 7], np.float32) * np.float32(tiny)
    outcomes = []
    for a in (x, xp.asarray(x)):
        try:
            got = ExDyna(k=5).reduce_dense(comm, a)
            outcomes.append(f"{got.nnz} entries")
        except ValueError as exc:
            outcomes.append(str(exc))
    ok = outcomes == ["the accumulated gradient holds a NaN on rank 0"] * 2
    assert_all(comm, ok, f"host: {outcomes[0]}; device: {outcomes[1]}")


@pytest.mark.parametrize("name", ALGORITHMS)
def test_device_moves_the_same_bytes_as_host(comm, xp, name):
    """Staging or not, device buffers change no byte or message that crosses between ranks.

    On the fake the algorithms alternate between staging and CUDA-aware (both modes of every
    primitive are covered by test_communicator_device_primitives)."""
    cls = algorithm_class(name)
    n = 20_000
    rng = np.random.default_rng([11, comm.rank])
    idx = np.concatenate([rng.integers(0, n, 150), np.arange(0, n, 500)])  # some overlap
    vals = rng.standard_normal(idx.shape[0]).astype(np.float32)
    modes = _modes(xp, comm)
    c = Communicator(comm.mpi_comm)
    c.cuda_aware = modes[ALGORITHMS.index(name) % len(modes)]
    host = _run(c, cls, vals, idx, n, 200)
    dev = _run(c, cls, xp.asarray(vals), xp.asarray(idx), n, 200)
    hs, ds = host.info["stats"], dev.info["stats"]
    problems = [] if hs == ds else [f"device {ds} != host {hs}"]
    why = _differs(dev, host)
    if why:
        problems.append(why)
    problems = [f"cuda_aware={c.cuda_aware}: {p}" for p in problems]
    assert_all(comm, not problems, f"{name}: " + "; ".join(problems))


@pytest.mark.parametrize("aware", [False, True], ids=["staged", "cuda_aware"])
def test_communicator_on_another_device_than_the_current(comm, xp, aware):
    """Buffers on GPU 1 while GPU 0 is current (as on a progress thread, which starts on
    device 0): staging, stream syncs and copy-backs happen on the buffers' own device (a
    strided send buffer is made contiguous by a kernel, which CuPy refuses to launch from
    another device), and so do what the calls allocate and compute (allreduce's float16
    copy, mean and result, allgatherv's receive buffer): results come back on GPU 1."""
    if aware not in _modes(xp, comm):
        pytest.skip("MPI is not CUDA-aware: device pointers must not reach it")
    if xp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    c = Communicator(comm.mpi_comm)
    c.cuda_aware = aware
    P, r = c.size, c.rank
    with xp.cuda.Device(1):
        x = xp.asarray(np.arange(10, dtype=np.float32) + 10 * r)[::2]
        got = xp.zeros(5, dtype=np.float32)
        buf = xp.asarray(np.arange(6, dtype=np.float64) * (r + 1))
        half = xp.asarray(np.arange(6, dtype=np.float16) * (r + 1))
    with xp.cuda.Device(0):
        reqs = [c.irecv(got, (r - 1) % P, 8), c.isend(x, (r + 1) % P, 8)]
        sparsecoll.comm.Request.waitall(reqs)
        c.allreduce(buf, out=buf)
        mean = c.allreduce(half, op="mean")
        gathered, _ = c.allgatherv(x)
    with xp.cuda.Device(1):
        ok = np.array_equal(_host(got), np.arange(0, 10, 2, dtype=np.float32) + 10 * ((r - 1) % P))
        ok = ok and np.array_equal(_host(buf), np.arange(6) * P * (P + 1) / 2)
        ok = ok and np.array_equal(_host(mean), (np.arange(6) * (P + 1) / 2).astype(np.float16))
        every = [np.arange(0, 10, 2, dtype=np.float32) + 10 * j for j in range(P)]
        ok = ok and np.array_equal(_host(gathered), np.concatenate(every))
    where = {a.device.id for a in (mean, gathered)}
    assert_all(comm, ok and where == {1}, f"cuda_aware={aware}: results on GPU {where}")


def test_allreduce_on_another_device_than_the_current(comm, xp):
    """Inputs on GPU 1 while GPU 0 is current (in this thread, and in iallreduce's progress
    thread, which starts on GPU 0 as every new CUDA host thread does) are checked, reduced
    and returned on GPU 1 (docs/guide/gpu.md), equal to the host run. Values and indices on two
    GPUs (on one rank) raise the same CollectiveTypeError on every rank."""
    if xp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    c = Communicator(comm.mpi_comm)
    n, k = 3000, 40
    rng = np.random.default_rng([21, comm.rank])
    idx = rng.integers(0, n, 80)
    vals = rng.standard_normal(80).astype(np.float32)
    with xp.cuda.Device(1):
        dv, di = xp.asarray(vals), xp.asarray(idx)
    problems = []
    for name in REPRESENTATIVE:
        cls = algorithm_class(name)
        host = _run(c, cls, vals, idx, n, k)
        with xp.cuda.Device(0):
            got = {"allreduce": _run(c, cls, dv, di, n, k)}
            algo = cls(**cls.default_options(n, k))
            got["iallreduce"] = sparsecoll.iallreduce(c, dv, di, n=n, algorithm=algo).wait()
        for how, dev in got.items():
            where = {dev.values.device.id, dev.indices.device.id}
            why = f"result on GPU {where}" if where != {1} else _differs(dev, host)
            if why:
                problems.append(f"{name} {how}: {why}")
    assert_all(comm, not problems, "; ".join(problems))
    bad = comm.size - 1
    with xp.cuda.Device(0 if comm.rank == bad else 1):
        di = xp.asarray(idx)
    with pytest.raises(CollectiveTypeError, match=f"same device.*GPU 1 and GPU 0 on rank {bad}"):
        sparsecoll.allreduce(c, dv, di, n=n)


@pytest.mark.parametrize("aware", [False, True], ids=["staged", "cuda_aware"])
def test_communicator_device_primitives(comm, xp, aware):
    if aware not in _modes(xp, comm):
        pytest.skip("MPI is not CUDA-aware: device pointers must not reach it")
    c = Communicator(comm.mpi_comm)
    c.cuda_aware = aware
    P, r = c.size, c.rank
    right, left = (r + 1) % P, (r - 1) % P
    pinned_before = len(getattr(xp, "pinned_allocations", []))
    problems = []

    def check(what, got, want):
        if not np.array_equal(_host(got), want):
            problems.append(what)

    # ring: send/recv, isend/irecv, sendrecv, recv_bytes into device memory
    x = xp.asarray(np.arange(7, dtype=np.float32) + 10 * r)
    want_left = np.arange(7, dtype=np.float32) + 10 * left
    got = xp.empty(7, dtype=np.float32)
    reqs = [c.irecv(got, left, 3), c.isend(x, right, 3)]
    sparsecoll.comm.Request.waitall(reqs)
    check("isend/irecv", got, want_left)
    got = xp.zeros(7, dtype=np.float32)
    c.sendrecv(x, right, got, left, 4)
    check("sendrecv", got, want_left)
    req = c.isend(x[1:4], right, 5)  # a view at an offset is sent contiguously
    raw = c.recv_bytes(left, 5, xp)
    req.wait()
    if not isinstance(raw, xp.ndarray):
        problems.append("recv_bytes left the device")
    check("send/recv_bytes", raw.view(np.float32), want_left[1:4])
    # collectives
    mine = xp.asarray(np.full(r % 3, r, dtype=np.int64))
    out, _counts = c.allgatherv(mine)
    check("allgatherv", out, np.concatenate([np.full(j % 3, j) for j in range(P)]))
    send = xp.asarray(np.repeat(np.arange(P, dtype=np.float64) + 100 * r, 2))
    out, _rc = c.alltoallv(send, [2] * P)
    check("alltoallv", out, np.repeat(100 * np.arange(P) + r, 2).astype(np.float64))
    for dt in (np.float16, np.float32, np.float64):
        out = c.allreduce(xp.asarray(np.arange(5, dtype=dt) * (r + 1)))
        if out.dtype != dt or not isinstance(out, xp.ndarray):
            problems.append(f"allreduce {dt} type")
        want = (np.arange(5) * P * (P + 1) // 2).astype(dt)
        check(f"allreduce {np.dtype(dt)}", out, want)
        buf, into = xp.asarray(np.arange(5, dtype=dt) * (r + 1)), xp.zeros(5, dtype=dt)
        if c.allreduce(buf, out=into) is not into:
            problems.append(f"allreduce out= {dt} returned another array")
        check(f"allreduce out= {np.dtype(dt)}", into, want)
        check(f"allreduce out= {np.dtype(dt)} input", buf, np.arange(5, dtype=dt) * (r + 1))
        if c.allreduce(buf, out=buf) is not buf:
            problems.append(f"allreduce in place {dt} returned another array")
        check(f"allreduce in place {np.dtype(dt)}", buf, want)
    if xp is fakecupy.module and P > 1:
        staged = len(xp.pinned_allocations) > pinned_before
        if staged == aware:
            problems.append(f"pinned staging {'used' if staged else 'unused'} with aware={aware}")
    assert_all(comm, not problems, ", ".join(problems))


def test_device_input_error_raises_on_every_rank(comm, xp):
    bad = comm.size - 1
    n = 50
    idx = np.array([1, 2, n if comm.rank == bad else 3])
    with pytest.raises(CollectiveInputError, match=f"index {n} out of range.*on rank {bad}"):
        sparsecoll.allreduce(comm, xp.asarray(np.ones(3)), xp.asarray(idx), n=n)
    # values on the device, indices on the host, on one rank only
    idx = np.array([1, 2, 3])
    mixed = idx if comm.rank == bad else xp.asarray(idx)
    with pytest.raises(CollectiveTypeError, match=f"same device.*on rank {bad}"):
        sparsecoll.allreduce(comm, xp.asarray(np.ones(3)), mixed, n=n)


def test_cuda_aware_detection(comm, monkeypatch):
    monkeypatch.setenv("SPARSECOLL_CUDA_AWARE", "1")
    forced_on = query_cuda_aware(comm.mpi_comm)
    monkeypatch.setenv("SPARSECOLL_CUDA_AWARE", "0")
    forced_off = query_cuda_aware(comm.mpi_comm)
    monkeypatch.delenv("SPARSECOLL_CUDA_AWARE")
    found = query_cuda_aware(comm.mpi_comm)
    everyone = comm.allgather_object(found)
    assert_all(comm, forced_on and not forced_off, "SPARSECOLL_CUDA_AWARE ignored")
    assert_all(comm, len(set(everyone)) == 1, f"ranks disagree: {everyone}")
    if "MPICH" in sparsecoll.comm.mpi_library_version() and os.environ.get("CI"):
        # the PyPI MPICH wheel is built without CUDA: staging is the right answer
        assert_all(comm, not found, "the MPICH wheel reported CUDA-aware")


def test_nccl_communicator(comm, xp):
    from sparsecoll.nccl import NCCLCommunicator, nccl_available

    real = xp is not fakecupy.module
    if not all(comm.allgather_object(nccl_available())):
        pytest.skip("NCCL is not usable through CuPy on every rank")
    if real:
        ndev = xp.cuda.runtime.getDeviceCount()
        if comm.size > ndev:
            # ranks share a GPU: every rank must get the same clear error, no hang
            with pytest.raises(ValueError, match="one GPU per rank"):
                NCCLCommunicator(comm.mpi_comm)
            return
    nc = NCCLCommunicator(comm.mpi_comm)
    try:
        c = Communicator(comm.mpi_comm)
        rng = np.random.default_rng([5, comm.rank])
        problems = []
        for name in REPRESENTATIVE:
            cls = algorithm_class(name)
            n = 3001
            idx = rng.integers(0, n, 60)
            vals = rng.standard_normal(60).astype(np.float32)
            h = sparsecoll.allreduce(c, vals, idx, n=n, algorithm=cls(**cls.default_options(n, 60)))
            d = sparsecoll.allreduce(
                nc,
                xp.asarray(vals),
                xp.asarray(idx),
                n=n,
                algorithm=cls(**cls.default_options(n, 60)),
            )
            if not np.array_equal(_host(d.indices), h.indices) or not np.allclose(
                _host(d.values), h.values, rtol=1e-5, atol=1e-6
            ):
                problems.append(f"{name}: result differs from MPI")
            if d.info["stats"].bytes_sent != h.info["stats"].bytes_sent:
                problems.append(f"{name}: bytes differ from MPI")
        counts = [(comm.rank + j) % 3 for j in range(comm.size)]
        x = np.arange(sum(counts), dtype=np.float64) + 100 * comm.rank
        a, ra = c.alltoallv(x, counts)
        b, rb = nc.alltoallv(xp.asarray(x), counts)
        if ra != rb or not np.array_equal(a, _host(b)):
            problems.append("alltoallv differs from MPI")
        # host buffers still go over MPI
        h, _ = nc.allgatherv(np.arange(3) + comm.rank)
        if not isinstance(h, np.ndarray):
            problems.append("host allgatherv left the host")
        assert_all(comm, not problems, "; ".join(problems))
    finally:
        nc.close()


def test_nccl_shared_gpu_is_refused_everywhere(comm, xp):
    if xp is not fakecupy.module:
        pytest.skip("covered on a real GPU by test_nccl_communicator when P > GPUs")
    if comm.size == 1:
        pytest.skip("one rank cannot share a GPU")
    from sparsecoll.nccl import NCCLCommunicator

    fakecupy._Device.shared = True
    try:
        with pytest.raises(ValueError, match="ranks 0 and 1 share GPU"):
            NCCLCommunicator(comm.mpi_comm)
    finally:
        fakecupy._Device.shared = False


def test_nccl_buffers_of_another_gpu_are_refused_everywhere(comm, xp):
    """An NCCLCommunicator moves the memory of the GPU it was built on only. A device array
    on another GPU (here on the last rank alone) went to NCCL as it was, silently on the fake
    (one host memory) and, on GPUs, on that rank's stream and NCCL's device: now every entry
    raises the same CollectiveInputError on every rank, naming the rank, before NCCL is
    called. And a call from a thread whose current GPU is another (a new thread is on GPU
    0) runs on the communicator's GPU: its results landed on the current one."""
    if xp is not fakecupy.module:
        pytest.skip("needs two GPUs per rank: the fake has them")
    import threading

    from sparsecoll.nccl import NCCLCommunicator
    from sparsecoll.training import GradientReducer

    with xp.cuda.Device(1):
        nc = NCCLCommunicator(comm.mpi_comm)
    try:
        last = comm.size - 1
        with xp.cuda.Device(0 if comm.rank == last else 1):
            m = max(6, comm.size)  # (alltoallv below sends one to each rank)
            x = xp.asarray(np.arange(m, dtype=np.float32) + comm.rank)
            idx = xp.asarray(np.arange(m))
        calls = {
            "allreduce dense": lambda: sparsecoll.allreduce(nc, x, idx, n=m, algorithm="dense"),
            "allreduce allgather": lambda: sparsecoll.allreduce(nc, x, idx, n=m),
            "step": lambda: GradientReducer(nc, m, "allgather", 0.5).step(x),
            "Communicator.allreduce": lambda: nc.allreduce(x),
            "allgatherv": lambda: nc.allgatherv(x),
            "alltoallv": lambda: nc.alltoallv(x[: comm.size], [1] * comm.size),
        }
        problems = []
        for name, call in calls.items():
            try:
                call()
                problems.append(f"{name}: no error")
            except CollectiveInputError as exc:
                if "is on GPU 0, not on GPU 1 where this NCCLCommunicator" not in str(
                    exc
                ) or not str(exc).endswith(f"on rank {last}"):
                    problems.append(f"{name}: {exc}")
        with xp.cuda.Device(1):
            y = xp.asarray(np.arange(comm.size, dtype=np.float64) + comm.rank)
        got = {}

        def run() -> None:  # (on GPU 0: a new thread's current device)
            got["allgatherv"] = nc.allgatherv(y)[0]
            got["alltoallv"] = nc.alltoallv(y, [1] * comm.size)[0]
            got["allreduce"] = nc.allreduce(y)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        where = {k: v.device.id for k, v in got.items()}
        if where != dict.fromkeys(("allgatherv", "alltoallv", "allreduce"), 1):
            problems.append(f"results of a thread on GPU 0 on GPUs {where}")
        elif not np.array_equal(
            got["allreduce"].get(), comm.size * np.arange(comm.size) + sum(range(comm.size))
        ):
            problems.append(f"allreduce from the thread: {got['allreduce'].get()}")
        assert_all(comm, not problems, "; ".join(problems))
    finally:
        nc.close()


def test_nccl_nonblocking_calls_are_refused_beside_a_running_engine(comm, xp):
    """Nonblocking calls on an NCCLCommunicator raise NotImplementedError, also once a
    Communicator on the same MPI communicator has started its progress engine: they were
    then queued there, and its progress thread made NCCL calls (silently, with the NCCL
    communicator that the user's thread calls too)."""
    if xp is not fakecupy.module:
        pytest.skip("the fake's NCCL records its calls")
    from sparsecoll.nccl import NCCLCommunicator
    from sparsecoll.training import GradientReducer

    vals, idx = np.ones(2, np.float32), np.array([1, 3])
    sparsecoll.iallreduce(comm, vals, idx, n=4).wait()  # the engine runs
    nc = NCCLCommunicator(comm.mpi_comm)
    try:
        fakecupy.nccl.calls.clear()
        dense = dict(n=4, algorithm="dense")
        calls = {
            "iallreduce": lambda: sparsecoll.iallreduce(
                nc, xp.asarray(vals), xp.asarray(idx), **dense
            ),
            "step_async": lambda: GradientReducer(nc, 2, "dense").step_async(xp.asarray(vals)),
        }
        got = []
        for name, call in calls.items():
            try:
                call().wait()
                got.append(f"{name} ran")
            except NotImplementedError as exc:
                if "not supported" not in str(exc):
                    got.append(f"{name}: {exc}")
        got += [f"NCCL calls {fakecupy.nccl.calls}"] if fakecupy.nccl.calls else []
        assert_all(comm, not got, "; ".join(got))
    finally:
        nc.close()


def test_torch_cuda_tensors(comm, xp):
    torch = fakecupy.require_torch_cuda(xp)
    dev = torch.device("cuda", xp.cuda.Device().id)
    n = 1000
    rng = np.random.default_rng([9, comm.rank])
    idx = rng.integers(0, n, 50)
    vals = rng.standard_normal(50).astype(np.float32)
    out = sparsecoll.allreduce(
        comm, torch.from_numpy(vals).to(dev), torch.from_numpy(idx).to(dev), n=n
    )
    ok = isinstance(out.values, torch.Tensor) and out.values.device == dev
    ref = sparsecoll.allreduce(comm, vals, idx, n=n)
    ok = ok and np.array_equal(out.indices.cpu().numpy(), ref.indices)
    ok = ok and np.allclose(out.values.cpu().numpy(), ref.values, rtol=1e-5, atol=1e-6)
    assert_all(comm, ok, "torch CUDA tensors did not round-trip")


@pytest.mark.parametrize("kind", ["mpi", "nccl"])
def test_gpu_allreduce_bench_runs(comm, xp, kind, capsys):
    """The benchmark's code path (on the fake its timings mean nothing and are not kept)."""
    from sparsecoll.benchmarks import gpu
    from sparsecoll.nccl import nccl_available

    if kind == "nccl" and (
        xp is not fakecupy.module or not all(comm.allgather_object(nccl_available()))
    ):
        pytest.skip("NCCL on a real GPU is covered by test_nccl_communicator")
    args = [
        "allreduce",
        "-n",
        "3000",
        "--density",
        "0.01",
        "-i",
        "1",
        "-x",
        "0",
        "--format",
        "csv",
        "--comm",
    ]
    rc = gpu.main([*args, kind, "--algorithm", "allgather", "--algorithm", "dense"])
    out = capsys.readouterr().out.strip().splitlines()
    ok = rc == 0 and (comm.rank != 0 or len(out) == 1 + 2)
    assert_all(comm, ok, f"rc={rc}, {len(out)} lines")


def test_osu_suite_with_device_buffers(comm, xp, capsys):
    """The OSU suite's ``-d cuda`` path, validated against dense (timings not kept)."""
    osu = pytest.importorskip("sparsecoll.benchmarks.osu")
    n = "4K" if xp is fakecupy.module else "1M"
    some = ",".join(a for a in ("allgather", "dsa", "oktopk", "exdyna") if a in ALGORITHMS)
    args = ["-d", "cuda", "-m", n, "-i", "1", "-x", "0", "-c", "-q", "--format", "csv"]
    rc = osu.main([*args, "--algorithm", some])
    out = capsys.readouterr().out
    assert_all(comm, rc == 0, f"osu -d cuda exited {rc}:\n{out[-2000:]}")


@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_gradient_reducer_on_device(comm, xp, name):
    """Training steps on device gradients: updates stay on the device and equal the host
    run's; error feedback holds (updates + residuals == gradients)."""
    training = pytest.importorskip("sparsecoll.training")
    if not hasattr(pytest.importorskip("sparsecoll.select"), "topk"):
        pytest.skip("sparsecoll.training needs the sparsecoll.select dispatch")
    n, steps = 2000, 2
    kw = dict(algorithm=name, density=0.02, warmup=1, average=False)
    host = training.GradientReducer(comm.mpi_comm, n, **kw)
    dev = training.GradientReducer(comm.mpi_comm, n, **kw)
    rng = np.random.default_rng([13, comm.rank])
    problems = []
    total_grad = np.zeros(n)
    total_update = np.zeros(n)
    for s in range(steps):
        g = rng.standard_normal(n).astype(np.float32)
        total_grad += comm.mpi_comm.allreduce(g.astype(np.float64))
        uh = host.step(g)
        ud = dev.step(xp.asarray(g))
        if not isinstance(ud, xp.ndarray):
            problems.append(f"step {s}: update left the device")
            break
        if not np.allclose(_host(ud), uh, rtol=1e-5, atol=1e-5):
            problems.append(f"step {s}: update differs from the host run")
        total_update += _host(ud)
    residuals = comm.mpi_comm.allreduce(_host(dev.residual).astype(np.float64))
    if not np.allclose(total_update + residuals, total_grad, rtol=1e-4, atol=1e-4):
        problems.append("updates + residuals != gradients")
    assert_all(comm, not problems, f"{name}: " + "; ".join(problems))
