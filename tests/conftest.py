"""Shared test configuration: hypothesis profiles, the mpiexec-only test folder, the quick
tier (``pytest -m quick``) and a summary of the mpiexec launches' times.

Profiles: ``dev`` (default, more examples, a fresh random draw each run, so local runs keep
exploring) and ``ci`` (fewer, chosen when CI is set and by the quick tier, derandomized: CI
checks a fixed, known set of examples rather than a new draw each time); pick one explicitly
with SPARSECOLL_HYPOTHESIS=dev|ci. Inside mpiexec (or torchrun) every rank must draw the same
examples, so the profile is derandomized there too, without a database or deadline; there
SPARSECOLL_HYPOTHESIS_SEED=S draws another fixed set instead (the same seed on every rank,
as ``--hypothesis-seed=S`` would), so local runs can explore the collectives' inputs too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

IN_MPIEXEC = os.environ.get("SPARSECOLL_IN_MPIEXEC") == "1"
IN_TORCHRUN = os.environ.get("SPARSECOLL_IN_TORCHRUN") == "1"
IN_LAUNCHER = IN_MPIEXEC or IN_TORCHRUN  # one of several ranks: every rank draws alike
SEED = os.environ.get("SPARSECOLL_HYPOTHESIS_SEED", "").strip() or None

_common = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=IN_LAUNCHER and SEED is None,
    database=None if IN_LAUNCHER else settings.default.database,
    print_blob=not IN_LAUNCHER,
)
settings.register_profile("dev", max_examples=60, **_common)
settings.register_profile(
    "ci", max_examples=12, **{**_common, "derandomize": True, "database": None}
)
settings.load_profile(
    os.environ.get("SPARSECOLL_HYPOTHESIS", "ci" if os.environ.get("CI") else "dev")
)

# tests/mpi/ runs only inside mpiexec, launched by tests/test_mpi.py; tests/torchrun/ only
# inside torchrun, launched by tests/test_torchrun.py.
collect_ignore = [d for d, inside in (("mpi", IN_MPIEXEC), ("torchrun", IN_TORCHRUN)) if not inside]


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """SPARSECOLL_HYPOTHESIS_SEED: the seed hypothesis's own plugin then applies. The quick
    tier (``-m quick``) draws the ``ci`` profile's examples, unless SPARSECOLL_HYPOTHESIS
    says otherwise (set here, so the mpiexec ranks it launches draw them too)."""
    if SEED is not None and config.getoption("hypothesis_seed", None) is None:
        config.option.hypothesis_seed = SEED
    if config.getoption("markexpr", "") == "quick" and not os.environ.get("SPARSECOLL_HYPOTHESIS"):
        os.environ["SPARSECOLL_HYPOTHESIS"] = "ci"
        settings.load_profile("ci")


@pytest.hookimpl(hookwrapper=True)
def pytest_collection_modifyitems(config, items):
    """Mark the quick tier (``-m quick``) before -k and -m deselect: every in-process test
    not marked ``mpi`` or ``slow`` (tests/test_mpi.py marks the collective contracts it
    adds). Then note which tests/mpi/ files each P runs: tests/test_mpi.py launches them
    in one mpiexec."""
    for item in items:
        if not any(item.iter_markers("mpi")) and not any(item.iter_markers("slow")):
            item.add_marker(pytest.mark.quick)
    yield
    from .mpirun import MPI_SELECTED

    chosen: dict[int, list] = {}
    for item in items:
        spec = getattr(item, "callspec", None)
        if getattr(item, "originalname", None) == "test_under_mpiexec" and spec is not None:
            chosen.setdefault(spec.params["nprocs"], []).append(spec.params["path"])
    config.stash[MPI_SELECTED] = chosen


def pytest_terminal_summary(terminalreporter, config):
    """Each mpiexec launch's seconds: starting the ranks, then each file's."""
    from .mpirun import LAUNCHES

    launches = config.stash.get(LAUNCHES, {})
    if not launches:
        return
    terminalreporter.section("mpiexec launches: seconds to start, then per file")
    for (nprocs, _), result in sorted(launches.items(), key=lambda kv: kv[0][0]):
        startup, seconds = result.seconds()
        files = sorted(seconds.items(), key=lambda kv: -kv[1])
        total = sum(seconds.values()) + (startup or 0.0)
        start = "?" if startup is None else f"{startup:.0f}"
        line = ", ".join(f"{name} {s:.1f}" for name, s in files)
        terminalreporter.write_line(f"-n {nprocs}: {total:.0f} s; start {start}; {line}")


_warming: list[subprocess.Popen] = []


def pytest_sessionstart(session):
    """Compile the Numba kernels on another core while the first tests run (tests/_warm.py),
    so that the tests and the mpiexec ranks load them from the cache instead of each
    compiling them; SPARSECOLL_WARM=0 turns it off. Not inside mpiexec or torchrun."""
    if IN_LAUNCHER or os.environ.get("SPARSECOLL_WARM", "1") == "0":
        return
    script = Path(__file__).with_name("_warm.py")
    _warming.append(
        subprocess.Popen(
            [sys.executable, str(script)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "SPARSECOLL_COMPILE_NOTICE": "0"},
        )
    )


def pytest_sessionfinish(session):
    """The warm-up is only ahead of the tests: stop it if the session ended first."""
    for proc in _warming:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
