"""Write sparsecoll/benchmarks/_tokens.py: the token frequencies of train_cluster.py's corpus.

The ``tokens`` overlap pattern of the benchmarks draws indices with these frequencies. The
corpus is the running CPython's standard library, tokenized as bench/train_cluster.py does;
the module keeps only the sorted counts, run-length encoded, so the pattern does not depend
on the Python that runs the benchmark.

    python bench/token_counts.py
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections import Counter
from pathlib import Path

from train_cluster import stdlib_words

OUT = Path(__file__).resolve().parents[1] / "sparsecoll" / "benchmarks" / "_tokens.py"


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__).parse_args(argv)
    words = stdlib_words()
    counts = sorted(Counter(words).values(), reverse=True)
    runs = Counter(counts)
    text = " ".join(f"{c}*{runs[c]}" if runs[c] > 1 else str(c) for c in sorted(runs)[::-1])
    lines = textwrap.wrap(text, 92)
    body = "\n".join(f'    "{line} "' for line in lines[:-1]) + f'\n    "{lines[-1]}"'
    version = sys.version.split()[0]
    OUT.write_text(
        f'"""Token frequencies of the corpus bench/train_cluster.py trains on.\n\n'
        f"The CPython {version} standard library's sources, tokenized as train_cluster.py "
        f"does:\n{len(words)} tokens, {len(counts)} distinct. ``COUNTS`` lists the counts "
        f"from the most frequent\ntoken down, run-length encoded (``c*m``: m tokens seen c "
        f"times each). Written by\n``python bench/token_counts.py``.\n"
        f'"""\n\nCOUNTS = (\n{body}\n)\n'
    )
    print(f"wrote {OUT}: {len(words)} tokens, {len(counts)} distinct, {len(runs)} counts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
