"""float16 error feedback over 20 steps of 4000 entries at density 0.05: how much of the
gradients the updates (× P) and the residuals miss, max and summed over entries against
sum |grad| (docs/training.md "float16 averages"). Run under mpiexec -n 3."""

import numpy as np
from mpi4py import MPI

from sparsecoll import GradientReducer

comm = MPI.COMM_WORLD
p, n = comm.size, 4000
for algo in ["allgather", "rabenseifner", "gtopk", "exdyna"]:
    red = GradientReducer(comm, n, algo, 0.05)
    applied, fed = np.zeros(n), np.zeros(n)
    for t in range(20):
        g = np.random.default_rng([t, comm.rank]).standard_normal(n).astype(np.float16)
        applied += red.step(g).astype(np.float64) * p
        fed += g
    residuals = comm.allreduce(red.residual.astype(np.float64))
    err = np.abs(applied + residuals - comm.allreduce(fed))
    scale = comm.allreduce(np.abs(fed)).sum()
    if comm.rank == 0:
        print(f"{algo:14s} max err {err.max():.3e}  sum err / sum|g| {err.sum() / scale:.3e}")
