"""The docs as a reader meets them. The ```python examples of README.md and docs/ run as
written (tests/docexamples.py says which run where): here at P = 1 in-process, the torch ones
in one 2-rank job; tests/mpi/test_docs.py runs them at every P. The ``>>>`` examples of
sparsecoll's docstrings run here too (doctest, one rank). Links resolve, the shell commands
parse and name scripts that exist, the README stays short, and the README and the guide say
what holds now: no commit hashes (a report names its commits once, at its top)."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from .docexamples import DOCS, ROOT, examples, parse


def _ids(found):
    return [ex.id for ex in found]


EVERY = examples()
RUN = examples("run")
TORCH = examples("torch")


@pytest.mark.parametrize("example", EVERY, ids=_ids(EVERY))
def test_example_compiles(example):
    example.compiled()


@pytest.mark.parametrize("example", RUN, ids=_ids(RUN))
def test_example_runs_on_one_rank(example):
    example.run()


@pytest.mark.mpi
def test_torch_examples_run_on_two_ranks():
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (pip install 'sparsecoll[torch]')")
    from .mpirun import run_mpi

    proc = run_mpi(2, ["-m", "tests.docexamples", "torch"], timeout=300)
    assert proc.returncode == 0, f"torch examples failed:\n{proc.stdout[-8000:]}"
    for ex in TORCH:  # both ranks report each (their lines may interleave)
        assert proc.stdout.count(f"example ok: {ex.id}:") == 2, proc.stdout[-4000:]


DOCTESTED = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for path in (ROOT / "sparsecoll").rglob("*.py")
    if ">>> " in path.read_text(encoding="utf-8")
)


@pytest.mark.parametrize("module", DOCTESTED)
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted and not result.failed, f"{result.failed} failed (printed above)"


def test_the_examples_are_found():
    """The extraction cannot go quietly empty: the README's first block and the torch and
    skipped ones are where the documents put them."""
    assert RUN and RUN[0].path.name == "README.md" and "sparsecoll.allreduce(" in RUN[0].code
    assert {ex.path.name for ex in TORCH} == {"README.md", "pytorch.md", "torch-backend.md"}
    assert {ex.path.name for ex in examples("jax")} == {"jax.md"}  # tests/mpi/test_jax.py
    assert [ex.id for ex in EVERY if ex.mode == "skip"] == [
        ex.id
        for ex in EVERY
        # (every gpu.md example; torch-backend.md's fragments need a launcher, or GPUs)
        if ex.path.name == "gpu.md" or (ex.path.name == "torch-backend.md" and ex.mode == "skip")
    ]
    assert {ex.path.parent.name for ex in EVERY} == {ROOT.name, "guide"}
    assert {ex.path for ex in EVERY} <= set(DOCS)
    assert {"sparsecoll.api", "sparsecoll.sparse", "sparsecoll.training.reducer"} <= set(DOCTESTED)


def test_markers_and_a_broken_example(tmp_path):
    text = "\n".join(
        [
            "```python",
            "x = 1",
            "```",
            "<!-- example: skip (needs a GPU) -->",
            "```python",
            "import cupy",
            "```",
            "```bash",
            "not python",
            "```",
            "<!-- example: torch -->",
            "```python",
            "y = x + 1",
            "```",
            "",
            "```python",
            "",
            "z = undefined_name",
            "```",
        ]
    )
    path = tmp_path / "doc.md"
    found = parse(text, path)
    assert [(ex.line, ex.mode, ex.reason) for ex in found] == [
        (2, "run", ""),
        (6, "skip", "needs a GPU"),
        (13, "torch", ""),
        (17, "run", ""),
    ]
    assert found[0].run()["x"] == 1
    with pytest.raises(NameError) as err:
        found[3].run()  # each example runs alone: no x, and the error is not swallowed
    assert str(err.traceback[-1].path) == str(path) and err.traceback[-1].lineno + 1 == 18
    with pytest.raises(ValueError, match="unknown example marker"):
        parse("<!-- example: skip -->\n```python\nx = 1\n```\n", path)
    with pytest.raises(ValueError, match="never closed"):
        parse("```python\nx = 1\n", path)


GUIDE = (ROOT / "README.md", ROOT / "docs" / "index.md", *sorted(ROOT.glob("docs/guide/*.md")))
REPORTS = sorted(ROOT.glob("docs/reports/*.md"))
REPORT_DATA = ROOT / "docs" / "reports" / "data"
# 7 to 40 hex digits with a letter and a digit among them: a commit, not a number or a word
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text without its fenced blocks (code, command output)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    heads = re.findall(r"^#+ (.+)$", _prose(path.read_text(encoding="utf-8")), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_readme_is_short_and_the_guide_has_no_commit_hashes():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 200
    assert len(GUIDE) >= 10
    found = {
        path.relative_to(ROOT).as_posix(): HASH.findall(path.read_text(encoding="utf-8"))
        for path in GUIDE
    }
    assert {where: hashes for where, hashes in found.items() if hashes} == {}


def test_the_hash_pattern():
    text = "at commit e950d70, 8842f79 and d24519bc9f; not 25557032, 1000000, decade or 0x1f"
    assert HASH.findall(text) == ["e950d70", "8842f79", "d24519bc9f"]


@pytest.mark.parametrize("report", REPORTS, ids=[p.name for p in REPORTS])
def test_a_report_is_stamped_once_at_its_top(report):
    """Its first paragraph says what made it; commits appear there and nowhere else."""
    paragraphs = report.read_text(encoding="utf-8").split("\n\n")
    title, stamp, rest = paragraphs[0], paragraphs[1], "\n\n".join(paragraphs[2:])
    assert title.startswith("# ") and stamp.startswith("Made by:"), stamp[:200]
    assert HASH.findall(title + rest) == []


@pytest.mark.parametrize("doc", DOCS, ids=[p.relative_to(ROOT).as_posix() for p in DOCS])
def test_links_resolve(doc):
    """Every relative link names a file or folder of the repository, and its #anchor a
    heading of the Markdown file it points to."""
    broken = []
    for target in LINK.findall(_prose(doc.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):
            continue  # http(s):, mailto:
        name, _, anchor = target.partition("#")
        path = (doc.parent / name).resolve() if name else doc
        if path.is_relative_to(REPORT_DATA) and not REPORT_DATA.is_dir():
            continue  # an unpacked sdist: the reports' raw data stays in the repository
        known = _anchors(path) if path.suffix == ".md" and path.is_file() else set()
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in known):
            broken.append(target)
    assert broken == []


def _commands(doc: Path) -> list[str]:
    """The ```bash blocks of a document."""
    return re.findall(r"^```bash\n(.*?)^```", doc.read_text(encoding="utf-8"), flags=re.M | re.S)


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("doc", DOCS, ids=[p.relative_to(ROOT).as_posix() for p in DOCS])
def test_commands_parse_and_name_scripts_that_exist(doc):
    for block in _commands(doc):
        run = subprocess.run(
            ["bash", "-n"], input=block, capture_output=True, text=True, timeout=60, check=False
        )
        assert run.returncode == 0, f"{doc.name}: {run.stderr}\n{block}"
    text = doc.read_text(encoding="utf-8")
    scripts = set(re.findall(r"\bbench/[\w.]+\.(?:py|sh)\b", text))
    assert sorted(s for s in scripts if not (ROOT / s).is_file()) == []


def test_the_two_setup_commands():
    """The README's set-up command and, after the marker, the test command .ci/run reads
    (the line after the marker's next line)."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert 'pip install -e ".[mpi]" && python -m sparsecoll bench' in lines
    marker = lines.index("<!-- test-command -->")
    assert lines[marker + 1] == "```bash"
    assert lines[marker + 2] == 'pip install -e ".[mpi,test]" && pytest'


def test_every_bench_script_is_listed_in_the_index():
    """bench/ holds the maintained benchmarks, each named in docs/index.md."""
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    scripts = sorted(p.name for p in (ROOT / "bench").iterdir() if p.suffix in (".py", ".sh"))
    assert scripts and [s for s in scripts if f"`bench/{s}`" not in index] == []
