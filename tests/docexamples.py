"""The ```python examples of README.md and docs/**/*.md, so a docs change that breaks one fails.

Every ```python block is an example, run as a script of its own (a fresh namespace): at
P = 1 in the test process (tests/test_docs.py) and under mpiexec at every P
(tests/mpi/test_docs.py). A marker comment on the line just before the opening fence
changes that:

    <!-- example: torch -->           run in one ``mpiexec -n 2`` job with the other torch
                                      examples (each sets up a torch process group; skipped
                                      without torch)
    <!-- example: jax -->             run under mpiexec at P = 2, 3 by tests/mpi/test_jax.py
                                      (skipped without jax)
    <!-- example: torchrun -->        run under torchrun (no MPI) by tests/torchrun/test_docs.py
                                      (each makes and ends its own process group)
    <!-- example: skip (REASON) -->   not run, REASON says why (a GPU, a cluster)

Every block compiles, skipped ones too. Tracebacks name the document and its line.
``python -m tests.docexamples torch`` runs the torch examples (what tests/test_docs.py
launches under mpiexec).
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = (  # the README, the guide and the reports; not the reports' raw files
    ROOT / "README.md",
    *sorted(
        p for p in (ROOT / "docs").rglob("*.md") if not p.is_relative_to(ROOT / "docs/reports/data")
    ),
)

_FENCE = re.compile(r"^(`{3,})\s*(\S*)")
_MARKER = re.compile(r"^<!--\s*example:\s*(.*?)\s*-->\s*$")
_SKIP = re.compile(r"skip \((.+)\)")


@dataclasses.dataclass(frozen=True)
class Example:
    path: Path
    line: int  # of the first code line, 1-based
    code: str
    mode: str  # "run", "torch", "jax", "torchrun" or "skip"
    reason: str = ""

    @property
    def id(self) -> str:
        where = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{Path(where).as_posix()}:{self.line}"

    def compiled(self):
        """The code object, with line numbers those of the document."""
        return compile("\n" * (self.line - 1) + self.code, str(self.path), "exec")

    def run(self) -> dict:
        """Execute the example as a script (``__name__ == "__main__"``); its namespace."""
        namespace = {"__name__": "__main__", "__file__": str(self.path)}
        exec(self.compiled(), namespace)
        return namespace


def parse(text: str, path: Path) -> list[Example]:
    """The ```python blocks of one Markdown text, with their markers."""
    lines = text.splitlines()
    found: list[Example] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(
            (j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1))), None
        )
        if end is None:
            raise ValueError(f"{path.name}:{i + 1}: code block never closed")
        if fence.group(2) == "python":
            marker = _MARKER.match(lines[i - 1]) if i else None
            mode, reason = "run", ""
            if marker:
                mode = marker.group(1)
                skip = _SKIP.fullmatch(mode)
                if skip:
                    mode, reason = "skip", skip.group(1)
                elif mode not in ("torch", "jax", "torchrun"):
                    raise ValueError(
                        f"{path.name}:{i}: unknown example marker {marker.group(0)!r}; "
                        "expecting 'example: torch', 'example: jax', 'example: torchrun' or "
                        "'example: skip (REASON)'"
                    )
            code = "\n".join(lines[i + 1 : end]) + "\n"
            found.append(Example(path, i + 2, code, mode, reason))
        i = end + 1
    return found


def examples(mode: str | None = None, paths: tuple[Path, ...] = DOCS) -> list[Example]:
    """Every example of the documents (those of one ``mode`` when given)."""
    every = [ex for path in paths for ex in parse(path.read_text(encoding="utf-8"), path)]
    return [ex for ex in every if mode is None or ex.mode == mode]


def _run_torch_examples() -> None:
    """Each torch example in turn, its process group torn down after it."""
    import torch.distributed as dist

    for ex in examples("torch"):
        ex.run()
        if dist.is_initialized():
            dist.destroy_process_group()
        print(f"example ok: {ex.id}:", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] != ["torch"]:
        raise SystemExit("usage: python -m tests.docexamples torch")
    _run_torch_examples()
