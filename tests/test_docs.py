"""The ```python examples of README.md and docs/*.md run as written (tests/docexamples.py says
which run where): here at P = 1 in-process, the torch ones in one 2-rank job;
tests/mpi/test_docs.py runs them at every P. The ``>>>`` examples of sparsecoll's docstrings
run here too (doctest, one rank), with the output they show."""

from __future__ import annotations

import doctest
import importlib
import importlib.util

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
    assert {ex.path.name for ex in TORCH} == {"README.md", "training.md"}
    assert [ex.id for ex in EVERY if ex.mode == "skip"] == [
        ex.id for ex in EVERY if ex.path.name == "gpu.md"
    ]
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
