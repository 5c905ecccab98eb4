"""One rank runs out of memory for a receive buffer whose size the other ranks' data set
(allgather's packed pairs, sized by the counts exchange just before the payload): what the ranks
see. Run: SPARSECOLL_TIMEOUT=5 mpiexec -n 2 python docs/results/memory_mid_exchange.py"""

import numpy as np

import sparsecoll
import sparsecoll.comm as scomm

comm = sparsecoll.Communicator()
real = np.empty


class _Failing:
    """numpy, whose empty() fails for bytes (the pairs' receive buffer)."""

    def __getattr__(self, name):
        return getattr(np, name)

    def empty(self, n, dtype=None):
        if np.dtype(dtype) == np.uint8:
            raise MemoryError(f"Unable to allocate {n} bytes (injected)")
        return real(n, dtype=dtype)


if comm.rank == comm.size - 1:
    scomm.get_array_module = lambda a: _Failing()
vals = np.ones(5, np.float32)
try:
    out = sparsecoll.allreduce(comm, vals, np.arange(5) + comm.rank, n=100)
    print(f"rank {comm.rank}: ok {out}", flush=True)
except Exception as e:
    print(f"rank {comm.rank}: {type(e).__name__}: {e}", flush=True)
