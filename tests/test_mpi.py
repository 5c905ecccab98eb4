"""Run the files of tests/mpi/ under mpiexec: the algorithms' files with P = 1, 2, 3, 4, 5
and 8 ranks, the error and API files (API_FILES) with P = 2 and 3.

Tiers: ``pytest -m quick`` runs the in-process tests (less those marked ``mpi`` or ``slow``)
and the collective contracts (QUICK_FILES) at P = 2 and 3; ``pytest`` runs everything.
While developing, ``SPARSECOLL_NPROCS=4 pytest`` (or ``=2,3``) runs every file at those P
only; CI (``CI`` set) ignores it.

Each P is one launch: the first test at that P runs every file selected at that P (``-k``,
``-m`` and SPARSECOLL_NPROCS choose) in one ``mpiexec -n P pytest -x``, whose ranks record
each test's outcome and each file's end (tests/mpi/conftest.py); each file's test then
reads its own from the records, and the session's summary lists each file's seconds.
A launch is killed when nothing moves for ``SPARSECOLL_MPI_TIMEOUT`` seconds (default
600): no output, no record. Under pytest-xdist each file still gets a launch of its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from .mpirun import LAUNCHES, MPI_SELECTED, ROOT, TIMEOUT, run_mpi_watched

MPI_FILES = sorted((Path(__file__).parent / "mpi").glob("test_*.py"))
NPROCS = [1, 2, 3, 4, 5, 8]
# Error and API paths: one rank's bad input raising on every rank, the communicators and
# input representations a user may pass (JAX arrays too), large-count fallbacks, the docs'
# examples, the bench scripts' input checks. P = 2 (one other rank) and 3 (several) cover them; the
# algorithms' files run at every P, since ranges, rounds and merge trees change with P.
API_FILES = frozenset(
    {
        "test_bench_scripts.py",
        "test_communicators.py",
        "test_docs.py",
        "test_errors.py",
        "test_jax.py",
        "test_large_counts.py",
        "test_representations.py",
        "test_torch_backend.py",
    }
)
API_NPROCS = [2, 3]
# The quick tier's collective contracts (pytest -m quick), at QUICK_NPROCS
QUICK_FILES = frozenset(
    {"test_bytes.py", "test_errors.py", "test_exact.py", "test_exdyna.py", "test_selecting.py"}
)
QUICK_NPROCS = [2, 3]


def select_nprocs(env: Mapping[str, str]) -> list[int] | None:
    """The P values SPARSECOLL_NPROCS lists, or None (unset, or CI set): each file's own."""
    text = env.get("SPARSECOLL_NPROCS", "").strip()
    if not text or env.get("CI"):
        return None
    try:
        chosen = [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"SPARSECOLL_NPROCS: expecting P or P,P,..., got {text!r}") from None
    if any(p < 1 for p in chosen):
        raise ValueError(f"SPARSECOLL_NPROCS: expecting P >= 1, got {text!r}")
    return chosen


def file_nprocs(name: str, chosen: list[int] | None) -> list[int]:
    """The P values a tests/mpi/ file runs at: those chosen, else its tier's."""
    if chosen is not None:
        return chosen
    return API_NPROCS if name in API_FILES else NPROCS


def mpi_cases(env: Mapping[str, str]) -> list:
    """(path, P) for every file at each of its P, ordered by P (one launch per P)."""
    chosen = select_nprocs(env)
    cases = []
    for p in sorted({p for f in MPI_FILES for p in file_nprocs(f.name, chosen)}):
        for f in MPI_FILES:
            if p in file_nprocs(f.name, chosen):
                quick = p in QUICK_NPROCS and f.name in QUICK_FILES
                marks = [pytest.mark.quick] if quick else []
                cases.append(pytest.param(f, p, id=f"{f.stem}-{p}", marks=marks))
    return cases


@dataclasses.dataclass
class Launch:
    """One ``mpiexec -n P pytest`` over several tests/mpi/ files, and what each rank recorded."""

    nprocs: int
    files: tuple[Path, ...]
    returncode: int
    output: str
    hung: bool  # killed after SPARSECOLL_MPI_TIMEOUT seconds without progress
    ranks: list[dict | None]  # per rank: collected, failed, done, collect_errors, ends
    started: float  # time.time() at the launch

    def seconds(self) -> tuple[float | None, dict[str, float]]:
        """Rank 0's seconds from the launch to its collection done (starting P processes,
        imports), and each file's seconds (the ranks wait for each other after a file)."""
        rec = self.ranks[0] if self.ranks else None
        if rec is None or rec["collected_at"] is None:
            return None, {}
        per_file, last = {}, rec["collected_at"]
        for nodeid, t in rec["ends"]:
            per_file[Path(nodeid).name] = t - last
            last = t
        return rec["collected_at"] - self.started, per_file

    def problem(self, path: Path) -> str | None:
        """Why ``path``'s tests did not pass at this P, or None if they did."""
        prefix = path.resolve().relative_to(ROOT).as_posix()

        def mine(nodeid: str) -> bool:
            return nodeid.split("::")[0] == prefix

        absent = [r for r, rec in enumerate(self.ranks) if rec is None]
        if absent:
            return f"rank(s) {absent} recorded nothing: pytest never started there?"
        ranks: list[dict] = self.ranks  # type: ignore[assignment]
        if any(mine(e) for rec in ranks for e in rec["collect_errors"]):
            return f"collecting {path.name} failed"
        failed = sorted({f for rec in ranks for f in rec["failed"] if mine(f)})
        if failed:
            return f"{len(failed)} failed: {', '.join(failed[:8])}"
        ids = {i for i in ranks[0]["collected"] if mine(i)}
        cut = [r for r, rec in enumerate(ranks) if not ids <= rec["done"]]
        if cut:
            if self.hung:
                why = "nothing moved for the idle timeout (a hang?): the launch was killed"
            else:
                failing = sorted(
                    {f.split("::")[0] for rec in ranks for f in rec["failed"]}
                    | {e.split("::")[0] for rec in ranks for e in rec["collect_errors"]}
                )
                why = f"mpiexec exited with {self.returncode}" + (
                    f" after failures in {', '.join(failing)} (-x)" if failing else ""
                )
            return f"did not complete on rank(s) {cut}: {why}"
        # (a launch that failed or hung elsewhere: that file's test says so)
        every = set(ranks[0]["collected"])
        complete = all(every <= rec["done"] for rec in ranks)
        clean = not any(rec["failed"] or rec["collect_errors"] for rec in ranks)
        if self.returncode != 0 and complete and clean:
            return f"every test passed, but mpiexec exited with {self.returncode}"
        return None


_launches: dict[tuple[int, tuple[Path, ...]], Launch] = {}


def _read(path: Path) -> dict | None:
    if not path.exists():
        return None
    rec: dict = {"collected": [], "failed": set(), "done": set(), "collect_errors": []}
    rec.update(collected_at=None, ends=[])
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if "collected" in entry:
            rec["collected"], rec["collected_at"] = entry["collected"], entry.get("t")
        elif "file_done" in entry:
            rec["ends"].append((entry["file_done"], entry["t"]))
        elif "failed" in entry:
            rec["failed"].add(entry["failed"])
        elif "done" in entry:
            rec["done"].add(entry["done"])
        elif "collect_error" in entry:
            rec["collect_errors"].append(entry["collect_error"])
    return rec


def launch(nprocs: int, files: tuple[Path, ...], idle: float = TIMEOUT) -> Launch:
    """The launch of ``files`` at ``nprocs`` ranks: run once, then looked up."""
    key = (nprocs, files)
    if key not in _launches:
        started = time.time()
        with tempfile.TemporaryDirectory(prefix="sparsecoll-mpi-") as tmp:
            args = ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *map(str, files)]
            proc, hung = run_mpi_watched(
                nprocs, args, Path(tmp), idle, env={"SPARSECOLL_MPI_RECORD": tmp}
            )
            ranks = [_read(Path(tmp) / f"rank{r}.jsonl") for r in range(nprocs)]
        _launches[key] = Launch(nprocs, files, proc.returncode, proc.stdout, hung, ranks, started)
    return _launches[key]


@pytest.mark.mpi
@pytest.mark.parametrize(("path", "nprocs"), mpi_cases(os.environ))
def test_under_mpiexec(path: Path, nprocs: int, request: pytest.FixtureRequest) -> None:
    files = tuple(request.config.stash.get(MPI_SELECTED, {}).get(nprocs, ()))
    if path not in files or os.environ.get("PYTEST_XDIST_WORKER"):
        files = (path,)  # (pytest-xdist: every worker would launch every file)
    result = launch(nprocs, files)
    request.config.stash.setdefault(LAUNCHES, {})[(nprocs, files)] = result
    problem = result.problem(path)
    assert problem is None, f"mpiexec -n {nprocs} {path.name}: {problem}\n{result.output[-8000:]}"


def test_nprocs_knob() -> None:
    assert select_nprocs({}) is None
    assert select_nprocs({"SPARSECOLL_NPROCS": "4"}) == [4]
    assert select_nprocs({"SPARSECOLL_NPROCS": "2,3"}) == [2, 3]
    assert select_nprocs({"SPARSECOLL_NPROCS": "4", "CI": "true"}) is None
    for bad in ("x", "0", "2,,3"):
        with pytest.raises(ValueError, match="SPARSECOLL_NPROCS"):
            select_nprocs({"SPARSECOLL_NPROCS": bad})


def test_tiers() -> None:
    """Every file runs somewhere; the API files at P = 2, 3, the rest at every P; the
    quick tier's contracts at P = 2, 3; SPARSECOLL_NPROCS runs every file at its P."""
    names = {f.name for f in MPI_FILES}
    assert names >= API_FILES | QUICK_FILES
    cases = {(c.values[0].name, c.values[1]): c for c in mpi_cases({"CI": "true"})}
    for name in names:
        want = API_NPROCS if name in API_FILES else NPROCS
        assert sorted(p for n, p in cases if n == name) == want, name
    quick = {key for key, c in cases.items() if any(m.name == "quick" for m in c.marks)}
    assert quick == {(n, p) for n in QUICK_FILES for p in QUICK_NPROCS}
    chosen = mpi_cases({"SPARSECOLL_NPROCS": "4"})
    assert sorted(c.values[0].name for c in chosen) == sorted(names)
    assert {c.values[1] for c in chosen} == {4}
    order = [c.values[1] for c in mpi_cases({})]
    assert order == sorted(order)  # (one launch per P, each P's files together)


def test_readme_says_how_to_run_each_tier() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert "pytest -m quick" in readme
    assert 'pytest -m "not mpi"' in readme
    assert "SPARSECOLL_NPROCS=4 pytest" in readme


HARNESS_FILES = {
    # rank 0 lags: rank 1 must not fail in test_b.py (and abort) before rank 0 finished here
    "test_a.py": (
        "import time\nfrom mpi4py import MPI\n\n"
        "def test_one():\n    pass\n\n"
        "def test_two():\n    time.sleep(2.0 if MPI.COMM_WORLD.Get_rank() == 0 else 0.0)\n"
    ),
    # fails on rank 1 only: that rank's record says so, and its abort ends the job
    "test_b.py": (
        "from mpi4py import MPI\n\n"
        "def test_fails_on_rank_1():\n    assert MPI.COMM_WORLD.Get_rank() != 1\n"
    ),
    "test_c.py": "def test_after():\n    pass\n",
    # rank 0 waits in a barrier that rank 1 never enters
    "test_d.py": (
        "import time\nfrom mpi4py import MPI\n\n"
        "def test_hangs():\n"
        "    if MPI.COMM_WORLD.Get_rank() == 0:\n        MPI.COMM_WORLD.Barrier()\n"
        "    else:\n        time.sleep(3600)\n"
    ),
}


@pytest.fixture
def harness_files():
    """Small test files in a folder of tests/mpi/ (its conftest records the outcomes; the
    session outside mpiexec does not collect there)."""
    folder = Path(tempfile.mkdtemp(prefix="_harness_", dir=Path(__file__).parent / "mpi"))
    try:
        paths = {}
        for name, text in HARNESS_FILES.items():
            (folder / name).write_text(text)
            paths[name[5]] = folder / name
        yield paths
    finally:
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()


@pytest.mark.mpi
def test_one_launch_tells_each_file_its_outcome(harness_files):
    f = harness_files
    result = launch(2, (f["a"], f["b"], f["c"]))
    assert result.problem(f["a"]) is None, result.output[-4000:]
    startup, seconds = result.seconds()
    assert startup is not None and startup > 0, result.ranks[0]
    assert seconds["test_a.py"] >= 2.0, seconds  # (rank 0 sleeps 2 s; rank 1 waits for it)
    assert "1 failed:" in (result.problem(f["b"]) or ""), result.output[-4000:]
    assert "test_fails_on_rank_1" in result.problem(f["b"])
    # (rank 1 stopped at its failure, -x; rank 0 may have run test_c before the abort)
    after = result.problem(f["c"]) or ""
    assert re.search(r"did not complete on rank\(s\) \[(0, )?1\]", after), after
    assert "after failures in" in after and "test_b.py (-x)" in after, after


@pytest.mark.mpi
def test_a_hung_launch_is_killed_and_said_so(harness_files):
    f = harness_files
    result = launch(2, (f["a"], f["d"]), idle=15)
    assert result.hung and result.problem(f["a"]) is None, result.output[-4000:]
    assert "a hang?" in (result.problem(f["d"]) or ""), result.output[-4000:]


@pytest.mark.mpi
def test_without_torch_every_rank_skips_alike(tmp_path):
    """With torch absent, the tests that use it skip (or leave their torch case out) on every
    rank alike: one rank skipping alone leaves the others waiting in the test's collective."""
    (tmp_path / "torch.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torch' (hidden)\", name='torch')\n"
    )
    names = ("test_errors.py", "test_nonblocking.py", "test_representations.py")
    files = [str(Path(__file__).parent / "mpi" / name) for name in names]
    keep = "unviewable or hook or representations or torch"
    args = ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", keep, *files]
    path = os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])
    proc, hung = run_mpi_watched(2, args, tmp_path, idle=120, env={"PYTHONPATH": path})
    assert not hung and proc.returncode == 0, proc.stdout[-4000:]
    assert "No module named 'torch' (hidden)" in proc.stdout, proc.stdout[-4000:]
