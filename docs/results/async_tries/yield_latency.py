"""Scratch: how long os.sched_yield() takes beside a matmul thread on one core, with the
kernel's slice (default) or a 100 us one (short). Run from this folder:
OPENBLAS_NUM_THREADS=1 taskset -c 1 python yield_latency.py default|short
"""
import os, sys, threading, time
import numpy as np
exec(open("slice_helper.py").read().split("mode = sys.argv[1]")[0])
mode = sys.argv[1]
stop = False
def compute():
    a = np.random.rand(400, 400)
    while not stop:
        a @ a
lat = []
def spinner():
    if mode == "short":
        set_slice(100_000)
    for _ in range(500):
        t = time.perf_counter()
        os.sched_yield()
        lat.append(time.perf_counter() - t)
        time.sleep(0.001)
t = threading.Thread(target=compute); t.start()
w = threading.Thread(target=spinner); w.start(); w.join(); stop = True; t.join()
lat = np.array(lat) * 1e3
print(mode, "yield median %.3f ms p90 %.3f p99 %.3f" % (np.median(lat), np.percentile(lat, 90), np.percentile(lat, 99)))
