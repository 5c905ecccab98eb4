#!/usr/bin/env python3
"""OSU-style sparse allreduce latency sweep; same as ``python -m sparsecoll bench osu``.

Run it under mpiexec (``mpiexec -n 4 python bench/osu_sparse_allreduce.py -m 1M:16M -c``), or
plain with ``--np P`` to relaunch itself under mpiexec. ``--help`` lists the options.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from sparsecoll.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["bench", "osu", *sys.argv[1:]]))
