"""Scratch: sched_setattr(2) of a 100 us slice for the calling thread, and the wake-up
latency of 200 us sleeps beside a matmul thread (python slice_helper.py default|short)."""
import ctypes, os, sys, threading, time, struct
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
mode = sys.argv[1]
stop = False
def compute():
    a = np.random.rand(400, 400)
    while not stop:
        a @ a
lat = []
def waker():
    if mode == "short":
        set_slice(100_000)
    for _ in range(2000):
        t = time.perf_counter()
        time.sleep(0.0002)
        lat.append(time.perf_counter() - t - 0.0002)
t = threading.Thread(target=compute); t.start()
w = threading.Thread(target=waker); w.start(); w.join(); stop = True; t.join()
lat = np.array(lat) * 1e3
print(mode, "median %.3f ms p90 %.3f p99 %.3f" % (np.median(lat), np.percentile(lat, 90), np.percentile(lat, 99)))
