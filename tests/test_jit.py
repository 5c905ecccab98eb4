"""Numba's on-disk cache of the kernels: a second process compiles nothing; the notice."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sparsecoll import _jit

pytest.importorskip("numba")

# a parallel kernel (the count, on 2 threads), a serial one (a merge of two vectors), and
# kernels built in one closure (hashed's stripes)
CODE = """
import numpy as np
from sparsecoll import _jit
from sparsecoll.algorithms import _merge
from sparsecoll.algorithms._stripes import Stripes
from sparsecoll.select import _numba_core, _numba_select
_numba_core.PARALLEL_MIN = 1
_numba_core._threads = 2
x = np.linspace(-1.0, 1.0, 64).astype(np.float32)
_numba_select.count_ge(x, 0.5)
_merge.merge_two(np.array([1, 4]), np.array([1.0, 2.0]), np.array([4, 6]), np.array([3.0, 5.0]), 10)
s = Stripes(1000, 3, 4)
owner, coords = s.locate(np.arange(0, 1000, 7))
s.indices(coords[owner == 1], 1)
s.gather([np.sort(coords[owner == j]) for j in range(3)])
print(_jit.compiles())
"""


def test_a_second_process_loads_the_kernels_from_the_cache(tmp_path):
    """With NUMBA_CACHE_DIR set, the first process compiles (and says so once, on stderr),
    the second loads every kernel it calls from the cache: no compile, no notice."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env.update(NUMBA_CACHE_DIR=str(tmp_path / "cache"), NUMBA_NUM_THREADS="2")
    for var in (*_jit.RANK_VARS, "SPARSECOLL_COMPILE_NOTICE"):
        env.pop(var, None)
    runs = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=600
        )
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append((int(out.stdout.split()[-1]), out.stderr))
    (first, err1), (second, err2) = runs
    assert first > 0
    assert err1.count(_jit.NOTICE) == 1, err1
    assert second == 0, f"the second process compiled {second} kernels"
    assert _jit.NOTICE not in err2, err2
    assert list((tmp_path / "cache").rglob("*.nbi"))


@pytest.mark.parametrize(
    ("env", "loud"),
    [
        ({}, True),
        ({"PMI_RANK": "0"}, True),
        ({"PMI_RANK": "2"}, False),
        ({"OMPI_COMM_WORLD_RANK": "1"}, False),
        ({"SPARSECOLL_COMPILE_NOTICE": "0"}, False),
        ({"PYTEST_CURRENT_TEST": "x"}, False),
    ],
)
def test_the_notice_shows_on_the_first_rank_outside_pytest(monkeypatch, env, loud):
    for var in (*_jit.RANK_VARS, "SPARSECOLL_COMPILE_NOTICE", "PYTEST_CURRENT_TEST"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert _jit._loud() is loud


def test_processes_sharing_a_cache_compile_each_kernel_once(tmp_path):
    """Two processes started together on an empty cache (as the ranks of a first run):
    each kernel is compiled by one of them, the other waits and loads it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env.update(NUMBA_CACHE_DIR=str(tmp_path / "cache"), NUMBA_NUM_THREADS="2")
    pipe = subprocess.PIPE
    cmd = [sys.executable, "-c", CODE]
    procs = [subprocess.Popen(cmd, stdout=pipe, stderr=pipe, text=True, env=env) for _ in "ab"]
    counts = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        counts.append(int(out.split()[-1]))
    kernels = len(list((tmp_path / "cache").rglob("*.nbi")))  # (one signature each)
    assert kernels > 0
    assert sum(counts) == kernels, (counts, kernels)


def test_a_failed_compile_lets_go_of_the_lock():
    """A kernel called with types it cannot take raises Numba's TypingError; the lock taken
    for its compile is released (no save follows), so other processes do not wait on it."""
    import numba
    import numpy as np

    from sparsecoll.select import _numba_edges

    kernel = _numba_edges._count_at_edges
    assert isinstance(kernel._cache, _jit._OneCompiler)
    with pytest.raises(numba.core.errors.TypingError):
        kernel(np.zeros(3, np.complex128), "edges", None)
    assert kernel._cache._fd is None
