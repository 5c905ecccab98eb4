"""Scratch (this session's try, not a bench script): the latency of a tiny iallreduce
(allgather, 4 entries) on 2 ranks, idle and beside a CPU-bound process per rank. With
slice_and_spin.patch applied: TMP_POLL_SPIN=seconds (the polling spin before the first sleep,
50e-6 the code's), SPARSECOLL_PROGRESS_SLICE_US=us (0: the kernel's slice). Run:
OPENBLAS_NUM_THREADS=1 TMP_POLL_SPIN=0 SPARSECOLL_PROGRESS_SLICE_US=100 mpiexec -n 2 python tiny_iallreduce_latency.py
"""
import os, sys, threading, time
import numpy as np
from mpi4py import MPI
import sparsecoll
import sparsecoll.comm as _c
_c.POLL_SPIN = float(os.environ.get("SPIN", _c.POLL_SPIN))
if os.environ.get("NOYIELD"): _c._yield = lambda: None
comm = MPI.COMM_WORLD
stop = False
def compute():
    a = np.random.rand(300, 300)
    while not stop:
        a @ a
v = np.ones(4, np.float32); i = np.arange(4) + comm.rank
for _ in range(20):
    sparsecoll.iallreduce(comm, v, i, n=1000, algorithm="allgather").wait()
res = {}
for mode in ["idle", "busy"]:
    if mode == "busy":
        import subprocess; t = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    comm.Barrier()
    lat = []
    for _ in range(300):
        t0 = time.perf_counter()
        sparsecoll.iallreduce(comm, v, i, n=1000, algorithm="allgather").wait()
        lat.append(time.perf_counter() - t0)
    res[mode] = np.array(lat) * 1e3
t.kill()
if comm.rank == 0:
    for k, l in res.items():
        print(os.environ.get("SPARSECOLL_PROGRESS_SLICE_US"), os.environ.get("SPIN"), os.environ.get("NOYIELD"), k, "median %.3f p90 %.3f ms" % (np.median(l), np.percentile(l, 90)))
