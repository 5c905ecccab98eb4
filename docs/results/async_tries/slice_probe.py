"""Scratch (not a bench script): beside a matmul thread, how late a 200 us sleep wakes up
(``sleep``) or how long an os.sched_yield() takes (``yield``), with the kernel's time slice
(``default``) or a 100 us one asked for with sched_setattr(2) (``short``). Run from this
folder, on one core:
OPENBLAS_NUM_THREADS=1 taskset -c 1 python slice_probe.py yield default|short
"""
import ctypes, os, sys, threading, time
import numpy as np
SYS_sched_setattr = {"x86_64": 314, "aarch64": 274}[os.uname().machine]
libc = ctypes.CDLL(None, use_errno=True)
class Attr(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("policy", ctypes.c_uint32), ("flags", ctypes.c_uint64),
                ("nice", ctypes.c_int32), ("prio", ctypes.c_uint32), ("runtime", ctypes.c_uint64),
                ("deadline", ctypes.c_uint64), ("period", ctypes.c_uint64),
                ("util_min", ctypes.c_uint32), ("util_max", ctypes.c_uint32)]
def set_slice(ns):
    a = Attr(size=ctypes.sizeof(Attr), policy=0, flags=0, nice=os.getpriority(os.PRIO_PROCESS, 0), runtime=ns)
    r = libc.syscall(SYS_sched_setattr, 0, ctypes.byref(a), 0)
    if r != 0:
        print("setattr failed", ctypes.get_errno(), os.strerror(ctypes.get_errno()))
what, mode = sys.argv[1], sys.argv[2]
stop = False
def compute():
    a = np.random.rand(400, 400)
    while not stop:
        a @ a
lat = []
def probe():
    if mode == "short":
        set_slice(100_000)
    for _ in range(2000 if what == "sleep" else 500):
        t = time.perf_counter()
        if what == "sleep":
            time.sleep(0.0002)
            lat.append(time.perf_counter() - t - 0.0002)
        else:
            os.sched_yield()
            lat.append(time.perf_counter() - t)
            time.sleep(0.001)
t = threading.Thread(target=compute); t.start()
w = threading.Thread(target=probe); w.start(); w.join(); stop = True; t.join()
lat = np.array(lat) * 1e3
print(mode, what, "median %.3f ms p90 %.3f p99 %.3f" % (np.median(lat), np.percentile(lat, 90), np.percentile(lat, 99)))
