"""Bytes sent per rank by one sparse allreduce of 1000 of 100000 entries: float16 values (what
the reducer's float16 sparse steps send, each rank's share) against the same values widened to
float32 (the alternative, docs/training.md "float16 averages"). Run under mpiexec -n 4."""

import numpy as np
from mpi4py import MPI

import sparsecoll
from sparsecoll import Communicator
from sparsecoll.registry import algorithm_class

comm = MPI.COMM_WORLD
c = Communicator.wrap(comm)
n, k = 100000, 1000
rng = np.random.default_rng(comm.rank)
idx = np.sort(rng.choice(n, k, replace=False)).astype(np.int32)
vals = rng.standard_normal(k).astype(np.float16)
for algo in ["allgather", "rabenseifner", "recursive_doubling", "gtopk", "oktopk", "dsa"]:
    row = []
    for dt in (np.float16, np.float32):
        a = sparsecoll.get_algorithm(algo, **algorithm_class(algo).default_options(n, k))
        sparsecoll.allreduce(c, vals.astype(dt), idx, n=n, algorithm=a)
        row.append(comm.allreduce(c.last_stats.bytes_sent) // comm.size)
    if comm.rank == 0:
        grow = 100 * (row[1] / row[0] - 1)
        print(f"{algo:20s} float16 {row[0]:8d}  float32 {row[1]:8d}  +{grow:.0f}%")
