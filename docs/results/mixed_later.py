"""Once the progress thread runs, rank 0 calls allreduce where rank 1 calls iallreduce (a
user's error): they wait on different communicators; the watchdog's summary names rank 1's
call. Run: mpiexec -n 2 python docs/results/mixed_later.py"""

import numpy as np

import sparsecoll

comm = sparsecoll.Communicator()  # COMM_WORLD
rank = comm.rank
v = np.ones(1, np.float32)
sparsecoll.iallreduce(comm, v, [rank], n=4).wait()  # starts the progress thread
sparsecoll.set_timeout(5)
if rank == 0:
    sparsecoll.allreduce(comm, v, [rank], n=4)
else:
    sparsecoll.iallreduce(comm, v, [rank], n=4).wait()
