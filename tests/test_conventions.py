"""API conventions, in-process: SparseRequest as concurrent.futures.Future, GradientReducer's
option messages, SparseVector's Python/numpy protocols, environment variables, the CLI."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest

import sparsecoll
from sparsecoll import Communicator, GradientReducer, SparseVector
from sparsecoll._progress import SparseRequest


def test_exception_waits_for_the_call_as_a_future_does():
    req = SparseRequest(1, "test call")
    with pytest.raises(TimeoutError, match="did not complete"):
        req.exception(timeout=0)  # pending: not None (which reads as a success)
    error = ValueError("bad input on rank 0")
    threading.Thread(target=req._finish, args=(None, error)).start()
    assert req.exception() is error  # (waits for the thread)
    ok = SparseRequest(2, "test call")
    ok._finish(3, None)
    assert ok.exception(timeout=0) is None and ok.result() == 3


def test_timeouts_are_seconds_as_a_future_takes_them():
    """wait(timeout=-1) raised TimeoutError "did not complete within -1 s", a str timeout
    threading's raw TypeError, NaN a TimeoutError "within nan s", infinity an OverflowError
    (set_timeout(inf): from its timer thread); set_timeout took "3" and True."""
    import concurrent.futures

    future = concurrent.futures.Future()
    with pytest.raises(TimeoutError):  # the convention: 0 or less does not wait
        future.result(timeout=-1)
    req = SparseRequest(1, "test call")
    with pytest.raises(TimeoutError, match=r"within 0 s \(timeout=-1: 0 or less does not wait"):
        req.wait(timeout=-1)
    for call in (req.wait, req.exception, sparsecoll.set_timeout):
        for bad in ("3", True, [1]):
            with pytest.raises(
                TypeError,
                match=re.escape(f"timeout must be a number of seconds or None, got {bad!r} ("),
            ):
                call(bad)
        with pytest.raises(
            ValueError, match="timeout must be a number of seconds or None, got nan"
        ):
            call(float("nan"))
    before = sparsecoll.get_timeout()
    try:
        sparsecoll.set_timeout(np.float32(2.5))
        assert sparsecoll.get_timeout() == 2.5
        sparsecoll.set_timeout(float("inf"))  # never fires: off
        assert sparsecoll.get_timeout() is None
    finally:
        sparsecoll.set_timeout(before)
    threading.Timer(0.05, req._finish, args=(3, None)).start()
    assert req.wait(timeout=float("inf")) == 3  # (as None)
    assert req.wait(timeout=-1) == 3 and req.exception(timeout=-5) is None  # (done: no wait)


def test_a_misspelled_reducer_option_is_named_with_a_did_you_mean():
    with pytest.raises(TypeError, match="got densty \\(did you mean 'density'\\?\\)") as info:
        GradientReducer(None, n=100, algorithm="oktopk", densty=0.1)
    assert "takes tau," in str(info.value)  # the options it takes: not k, which it refuses
    with pytest.raises(TypeError, match="got taux \\(did you mean 'tau'\\?\\)"):
        GradientReducer(None, n=100, algorithm="oktopk", taux=3)


def test_a_misspelled_selection_option_lists_the_selections_options():
    with pytest.raises(TypeError, match="selection 'reuse'.* takes interval, .*") as info:
        GradientReducer(None, n=100, selection="reuse", selection_options={"intervall": 3})
    assert "(did you mean 'interval'?)" in str(info.value)
    assert "__init__" not in str(info.value)


def test_selection_options_for_the_exact_selection_are_refused():
    with pytest.raises(ValueError, match="selection='exact' takes no options.*'reuse'"):
        GradientReducer(None, n=4, selection_options={"interval": 3})
    GradientReducer(None, n=4, selection_options={})  # (nothing to leave unused)


@pytest.mark.parametrize("selection", ["reuse", "sampling", "gaussian"])
def test_an_estimator_for_an_algorithm_without_a_local_topk_is_refused(selection):
    """dense and exdyna take no local top-k: the estimator was built, checkpointed and
    agreed on but never consulted (the steps were those of selection='exact'), silently."""
    for algorithm, how in [("dense", "densely"), ("exdyna", "selects by itself")]:
        with pytest.raises(ValueError, match=f"selection='{selection}' would go unused.*{how}"):
            GradientReducer(None, n=100, algorithm=algorithm, selection=selection)
        GradientReducer(None, n=100, algorithm=algorithm, selection="exact")
    GradientReducer(None, n=100, algorithm="oktopk", selection=selection)  # (it takes one)


def test_out_that_is_not_c_contiguous_is_named_so():
    red = GradientReducer(None, n=12, algorithm="allgather", density=1.0)
    grad = np.arange(12, dtype=np.float32).reshape(3, 4)
    with pytest.raises(ValueError, match="out must be C-contiguous"):
        red.step(grad, out=np.asfortranarray(np.zeros((3, 4), np.float32)))


def test_sparse_vector_protocols():
    v = SparseVector.from_coo([4, 1, 4], np.array([1.0, 2.0, 3.0], np.float32), n=6)
    assert repr(SparseVector([3, 1], [1.0, 2.0], 4)) == "SparseVector(n=4, nnz=2, dtype=list)"
    assert v.shape == (6,) and len(v) == 6
    dense = np.asarray(v)  # the dense vector, not a 0-d object array
    assert dense.dtype == np.float32 and np.array_equal(dense, v.to_dense())
    assert np.asarray(v, dtype=np.float64).dtype == np.float64
    empty = SparseVector.empty(5)
    for x in (v, empty):  # an empty result (nnz 0) of length 5 was true
        with pytest.raises(ValueError, match="ambiguous.*nnz > 0"):
            bool(x)


@pytest.mark.parametrize("bad", ["x", "-1", "0", "2.5"])
def test_a_bad_num_threads_variable_is_an_error_naming_it(monkeypatch, bad):
    numba_kernels = pytest.importorskip("sparsecoll.select._numba_core")
    monkeypatch.setattr(numba_kernels, "_threads", None)  # (read again)
    monkeypatch.setenv("SPARSECOLL_NUM_THREADS", bad)
    with pytest.raises(ValueError, match=f"SPARSECOLL_NUM_THREADS must be .*got '{bad}'"):
        numba_kernels.get_num_threads()
    monkeypatch.setattr(numba_kernels, "_threads", None)
    monkeypatch.setenv("SPARSECOLL_NUM_THREADS", " 1 ")
    assert numba_kernels.get_num_threads() == 1


@pytest.mark.parametrize(
    ("text", "poll"),
    [
        *[("1", True), ("true", True), ("YES", True), ("on", True), ("0", False)],
        *[("off", False), ("No", False), ("false", False), ("", False)],
    ],
)
def test_the_poll_variable_takes_the_usual_spellings(monkeypatch, text, poll):
    from mpi4py import MPI

    monkeypatch.setenv("SPARSECOLL_POLL", text)
    assert Communicator(MPI.COMM_SELF).poll is poll


@pytest.mark.parametrize("name", ["SPARSECOLL_POLL", "SPARSECOLL_CUDA_AWARE"])
def test_a_bad_flag_variable_is_an_error_naming_it(monkeypatch, name):
    from mpi4py import MPI

    from sparsecoll._mpilib import query_cuda_aware

    monkeypatch.setenv(name, "maybe")
    with pytest.raises(ValueError, match=f"{name} must be one of 1, true, .*got 'maybe'"):
        Communicator(MPI.COMM_SELF) if name == "SPARSECOLL_POLL" else query_cuda_aware()


def test_cli_version_and_an_unknown_suite(capsys):
    from sparsecoll import __version__
    from sparsecoll.__main__ import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"sparsecoll {__version__}"
    assert main(["bench", "osuu"]) == 2  # (before any launch)
    err = capsys.readouterr().err
    assert "unknown suite 'osuu' (did you mean 'osu'?); suites: main, osu" in err
    assert "unrecognized arguments" not in err


def test_communicator_repr_and_comm_none_is_comm_world():
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    shown = f"<sparsecoll.Communicator rank {world.rank} of {world.size} on MPI_COMM_WORLD>"
    assert repr(Communicator(None)) == shown
    vals, idx = np.ones(2, np.float32), [3, 1]
    assert sparsecoll.allreduce(None, vals, idx, n=4).indices.tolist() == [1, 3]
    assert sparsecoll.iallreduce(None, vals, idx, n=4).wait().indices.tolist() == [1, 3]
    assert GradientReducer(None, n=4, density=0.5).comm.mpi_comm == world


def test_accumulate_names_c_contiguity():
    """select.accumulate's buffers must be C-contiguous (1-D: a strided view is not); the
    message said only 'contiguous', as the reducer's out= did."""
    from sparsecoll import select

    grad = np.ones(12)
    out = np.empty(24)[::2]
    with pytest.raises(ValueError, match="out must be C-contiguous"):
        select.accumulate(grad, out=out)


def test_numba_writes_no_terminal_escape_at_exit():
    """Under Open MPI 4 a rank's stdout is a pseudo-terminal, and Numba's coloured error
    messages (built while it compiles) made colorama write ESC[0m there at exit, into CSV
    and JSON output. sparsecoll turns the colouring off unless the user set it."""
    import os
    import subprocess
    import sys

    name = "NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING"
    code = (
        "import os, sparsecoll, numba.core.errors as e; "
        f"print(type(e.termcolor()).__name__, os.environ['{name}'])"
    )
    env = {k: v for k, v in os.environ.items() if k != name}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["NOPColorScheme", "1"]
