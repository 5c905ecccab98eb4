"""Instructions per ``sparsecoll.allreduce`` call on one rank, counted by valgrind.

Times of microsecond calls on a shared 2-core machine swing by several times from run to
run; instruction counts do not (the same binary, input and environment give the same
count whatever else runs). This runs itself once under ``valgrind --tool=callgrind`` as a
single MPI process, calls ``sparsecoll.allreduce`` ``--calls`` times per algorithm (named,
so a new instance each call, as ``allreduce(comm, v, i, n=n, algorithm="oktopk", k=k)``
does; after 5 warm-up calls) on an n-entry input with ``--nnz`` nonzeros, and prints the
instructions per call of each algorithm, the interpreter's and every library's included.

    python bench/call_instructions.py                # n = 4096, 41 nonzeros, 20 calls
    python bench/call_instructions.py -m 64K --nnz 655
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile

ALGORITHMS = "dense,allgather,recursive_doubling,dsa,oktopk,exdyna,gtopk"


def child(algorithms: list[str], n: int, nnz: int, calls: int) -> None:
    """Under callgrind: each algorithm's timed calls between two getpgrp() calls, where
    ``--dump-before=getpgrp`` starts a new dump."""
    import numpy as np

    import sparsecoll
    from sparsecoll._mpilib import mpi as _mpi

    comm = _mpi().COMM_WORLD
    rng = np.random.default_rng(0)
    idx = np.sort(rng.choice(n, nnz, replace=False)).astype(np.int64)
    val = rng.standard_normal(nnz).astype(np.float32)
    for name in algorithms:
        kw = {"k": nnz} if name in ("oktopk", "exdyna", "gtopk") else {}
        for _ in range(5):
            sparsecoll.allreduce(comm, val, idx, n=n, algorithm=name, **kw)
        os.getpgrp()
        for _ in range(calls):
            sparsecoll.allreduce(comm, val, idx, n=n, algorithm=name, **kw)
        os.getpgrp()


def main(argv: list[str] | None = None) -> None:
    from sparsecoll.benchmarks.cli import SIZE_HELP, RankZeroParser, int_arg, size_arg

    ap = RankZeroParser(description=__doc__.split("\n\n")[0], epilog=SIZE_HELP)
    ap.add_argument("-m", "--message-size", type=size_arg, default=4096, help="n (entries)")
    ap.add_argument("--nnz", type=int_arg(1), default=41, help="nonzeros (and k)")
    ap.add_argument("--calls", type=int_arg(1), default=20)
    ap.add_argument("--algorithms", default=ALGORITHMS, help="comma-separated names")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    names = [a for a in args.algorithms.split(",") if a]
    if args.nnz > args.message_size:
        ap.error(f"argument --nnz: {args.nnz} nonzeros do not fit in n = {args.message_size}")
    if args.child:
        child(names, args.message_size, args.nnz, args.calls)
        return
    if shutil.which("valgrind") is None:
        ap.error("valgrind is not installed (Debian: apt-get install valgrind)")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.out")
        cmd = [
            "valgrind", "--tool=callgrind", "--dump-before=getpgrp",
            f"--callgrind-out-file={out}", sys.executable, os.path.abspath(__file__),
            "-m", str(args.message_size), "--nnz", str(args.nnz), "--calls", str(args.calls),
            "--algorithms", ",".join(names), "--child",
        ]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True)
        totals = []
        for path in sorted(glob.glob(out + ".*"), key=lambda p: int(p.rsplit(".", 1)[1])):
            with open(path) as f:
                head = ("summary:", "totals:")
                totals.append(next(int(ln.split()[1]) for ln in f if ln.startswith(head)))
    # the last 2 per algorithm: [warm-up .. getpgrp], [timed calls .. getpgrp]
    timed = totals[-2 * len(names) :][1::2]
    print(f"# instructions per sparsecoll.allreduce call, one rank: n={args.message_size} "
          f"nnz={args.nnz} calls={args.calls} (valgrind --tool=callgrind)")  # fmt: skip
    for name, count in zip(names, timed):
        print(f"{name:20s} {count / args.calls / 1e6:8.3f} M")


if __name__ == "__main__":
    main()
