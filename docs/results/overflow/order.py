"""Partial sums past the dtype's largest value: each exact algorithm's summation order decides
what an index whose true sum is 0 comes out as (docs/api.md). Run under mpiexec -n 4."""
import numpy as np
from mpi4py import MPI

import sparsecoll

comm = MPI.COMM_WORLD
r, P = comm.Get_rank(), comm.Get_size()
for dtype, big in (("float16", 60000.0), ("float32", 3e38)):
    v = np.array([big if r < P // 2 else -big], dtype)  # ranks 0..P/2-1: +big, the rest -big
    for name in ("allgather", "dsa", "recursive_doubling", "rabenseifner", "dense"):
        out = sparsecoll.allreduce(comm, v, [1], n=4, algorithm=name)
        got = dict(zip(out.indices.tolist(), out.values.tolist())).get(1, "absent (0)")
        if r == 0:
            print(f"P={P} {dtype} ±{big:g}: {name:18s} index 1 = {got}")
