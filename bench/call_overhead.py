"""The fixed cost of a call: sparsecoll's small collectives against MPI's own.

Where messages are small (a few thousand entries, or a DDP bucket of a small layer), the
wire takes microseconds and what a call costs is its own work: Python, checks, metadata
rounds. For each call this prints

* ``wall``: its latency, the slowest rank's, median over the timed calls;
* ``cpu``: rank 0's CPU time per call (``time.thread_time``, median over the timed calls),
  what the call costs the calling thread whatever the others do (busy-polling waits in MPI
  included: MPICH's blocking calls spin);

for MPI's own ``Allreduce`` of the dense vector and ``Allgather`` of one int (the floor),
the Communicator's metadata and payload calls, and ``sparsecoll.allreduce`` with a reused
instance of every algorithm on the same n-entry, 1%-dense input (random indices per rank).

    mpiexec -n 2 python bench/call_overhead.py
    mpiexec -n 4 python bench/call_overhead.py -m 64K -i 500
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    from sparsecoll.benchmarks.cli import (
        SIZE_HELP,
        RankZeroParser,
        density_arg,
        int_arg,
        size_arg,
    )

    ap = RankZeroParser(description=__doc__.split("\n\n")[0], epilog=SIZE_HELP)
    ap.add_argument("-m", "--message-size", type=size_arg, default=4096, help="n (entries)")
    ap.add_argument("--density", type=density_arg, default=0.01)
    ap.add_argument("-i", "--iterations", type=int_arg(1), default=300)
    ap.add_argument("-x", "--warmup", type=int_arg(0), default=30)
    args = ap.parse_args(argv)

    import sparsecoll
    from sparsecoll import Communicator
    from sparsecoll._mpilib import mpi as _mpi
    from sparsecoll._mpilib import mpi_library_version
    from sparsecoll.registry import algorithm_options, available_algorithms

    MPI = _mpi()
    comm = Communicator()
    world = comm.mpi_comm
    n = args.message_size
    k = max(1, round(args.density * n))
    rng = np.random.default_rng([7, comm.rank])
    idx = np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)
    val = rng.standard_normal(k).astype(np.float32)
    dense = np.zeros(n, np.float32)
    dense[idx] = val
    summed = np.empty_like(dense)
    one = np.array([k], np.int64)
    ones = np.empty(comm.size, np.int64)
    split = [k // comm.size] * comm.size

    def timed(call: Callable[[], Any]) -> tuple[float, float]:
        for _ in range(args.warmup):
            call()
        wall, cpu = [], []
        for _ in range(args.iterations):
            world.Barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            call()
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - t0)
        slowest = np.empty(len(wall))
        world.Allreduce(np.asarray(wall), slowest, op=MPI.MAX)
        return float(np.median(slowest)) * 1e6, float(np.median(cpu)) * 1e6

    calls: list[tuple[str, Callable[[], Any]]] = [
        ("MPI Allreduce (dense n)", lambda: world.Allreduce(dense, summed)),
        ("MPI Allgather (one int)", lambda: world.Allgather(one, ones)),
        ("Communicator.allgather_ints", lambda: comm.allgather_ints(k)),
        ("Communicator.allgatherv", lambda: comm.allgatherv(val)),
        ("Communicator.alltoallv", lambda: comm.alltoallv(val, split)),
        ("Communicator.allreduce (dense n)", lambda: comm.allreduce(dense, out=summed)),
    ]
    for name in available_algorithms():
        takes_k = "k" in algorithm_options(name)
        algo = sparsecoll.get_algorithm(name, **({"k": k} if takes_k else {}))

        def reduce(algo: Any = algo) -> Any:
            return sparsecoll.allreduce(comm, val, idx, n=n, algorithm=algo)

        calls.append((f"allreduce {name}", reduce))

    rows = [(name, *timed(call)) for name, call in calls]
    if comm.rank == 0:
        print(f"# sparsecoll {sparsecoll.__version__} call overhead: {mpi_library_version()}")
        print(f"# P={comm.size} n={n} nnz/rank={k} float32, iterations={args.iterations}")
        print("# wall: slowest rank, median; cpu: rank 0's thread CPU time, median")
        print(f"{'call':36s} {'wall(us)':>10s} {'cpu(us)':>10s}")
        for name, wall, cpu in rows:
            print(f"{name:36s} {wall:10.1f} {cpu:10.1f}")


if __name__ == "__main__":
    main()
