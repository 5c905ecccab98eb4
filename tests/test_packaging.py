"""What the sdist and the wheel carry (built with setuptools, as ``pip``/``python -m build`` do)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REPORT_DATA = ROOT / "docs" / "reports" / "data"  # raw files: in the repository only


@pytest.fixture(scope="module")
def build_path(tmp_path_factory) -> str:
    """Where a setuptools recent enough for pyproject (>= 77: its SPDX license string) is
    found: the running one's, else one pip puts in a temporary folder, as pip's isolated
    builds do (a fresh virtual environment carries setuptools 65)."""
    try:
        import setuptools

        if int(setuptools.__version__.split(".")[0]) >= 77:
            return ""
    except ImportError:
        pass
    where = tmp_path_factory.mktemp("setuptools")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--target", str(where)]
    run = subprocess.run(
        [*pip, "setuptools>=77"], capture_output=True, text=True, timeout=300, check=False
    )
    if run.returncode:
        pytest.skip(f"no setuptools >= 77 to build with: {run.stderr[-300:]}")
    return str(where)


def _build(kind: str, tmp: Path, path: str) -> Path:
    """Build the sdist or the wheel of a copy of the checkout (setuptools' PEP 517 hooks, in
    this interpreter). A copy: setuptools keeps the files an earlier build's
    ``sparsecoll.egg-info/SOURCES.txt`` lists, whatever MANIFEST.in says."""
    skip = ("*.egg-info", ".git", ".venv*", "__pycache__", "build", "dist", "out", ".whl")
    src = shutil.copytree(ROOT, tmp / "src", ignore=shutil.ignore_patterns(*skip))
    out = tmp / "out"
    code = f"from setuptools import build_meta as b; print(b.build_{kind}({str(out)!r}))"
    env = {**os.environ, "PYTHONPATH": path} if path else None
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return out / run.stdout.strip().splitlines()[-1]


def test_the_sdist_carries_what_the_tests_read(tmp_path, build_path):
    """An unpacked sdist runs its own tests: tests/ whole (tests/mpi, conftest.py, the
    helpers and tests/data), the docs test_docs.py checks, the bench scripts, the CI script;
    and the LICENSE. The reports' raw data stays out."""
    with tarfile.open(_build("sdist", tmp_path, build_path)) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    patterns = ("tests/**/*.py", "tests/data/**/*", "docs/**/*.md", "bench/*", ".ci/run")
    wanted = [
        p.relative_to(ROOT).as_posix()
        for pattern in patterns
        for p in ROOT.glob(pattern)
        if p.is_file() and "__pycache__" not in p.parts and not p.is_relative_to(REPORT_DATA)
    ]
    assert {"tests/mpi/test_errors.py", "docs/index.md", "tests/data/shm_p2.csv"} <= {*wanted}
    assert sorted({*wanted, "LICENSE"} - names) == []
    assert REPORT_DATA.is_dir()
    assert [name for name in names if name.startswith("docs/reports/data")] == []
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]


def test_the_wheel_is_the_package_with_its_data(tmp_path, build_path):
    with zipfile.ZipFile(_build("wheel", tmp_path, build_path)) as whl:
        names = set(whl.namelist())
        entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        scripts = whl.read(entry).decode()
        meta = whl.read(entry.replace("entry_points.txt", "METADATA")).decode()
        licensed = entry.replace("entry_points.txt", "licenses/LICENSE")
        license_text = whl.read(licensed).decode() if licensed in names else ""
    assert "sparsecoll/py.typed" in names
    assert {n.split("/")[0] for n in names} == {"sparsecoll", entry.split("/")[0]}
    assert "sparsecoll = sparsecoll.__main__:main" in scripts
    assert "License-Expression: BSD-3-Clause" in meta
    # the license's text, which BSD-3-Clause asks binary redistributions to carry (there
    # was no LICENSE file: the wheel named the license but held no copy of it)
    assert "\nLicense-File: LICENSE\n" in meta
    assert license_text == (ROOT / "LICENSE").read_text()
    assert "Copyright (c) 2026, the sparsecoll developers" in license_text
    # The version has one source, sparsecoll/__init__.py; the metadata carries it.
    version = re.search(
        r'^__version__ = "(.+)"$', (ROOT / "sparsecoll/__init__.py").read_text(), re.M
    )
    assert f"\nVersion: {version.group(1)}\n" in meta
