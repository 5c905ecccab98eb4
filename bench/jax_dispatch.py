"""The fixed cost of a call into the library from a jitted CPU program, on one process.

    python bench/jax_dispatch.py --calls 2000

Times a jitted function whose one call into Python does nothing, on each way such a call can
be made: chained in the function's body (the FFI path's default), carrying JAX's ordered
effect (a call in a loop body: here a one-trip ``fori_loop``), and ``io_callback(ordered=
True)`` (``SPARSECOLL_JAX_FFI=0``, or a GPU); beside a jitted function with no call. Prints
the median microseconds per call, dispatch to result ready.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from sparsecoll.integrations.jax import _ffi


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    if not _ffi.available():
        raise SystemExit(f"the FFI path could not be set up: {_ffi._state.get('error')}")
    shapes = [jax.ShapeDtypeStruct((8,), jnp.float32)]

    def nothing(ins, outs):
        pass

    def call(x):
        return _ffi.call(nothing, shapes, x)[0]

    def callback(x):
        return jax.experimental.io_callback(lambda x: x, shapes[0], x, ordered=True)

    programs = {
        "no call": lambda x: x + 1,
        "chained (function body)": call,
        "ordered effect (loop body)": lambda x: jax.lax.fori_loop(0, 1, lambda i, y: call(y), x),
        "io_callback(ordered=True)": callback,
    }
    x = jnp.ones(8, jnp.float32)
    print(f"# jax {jax.__version__}, one process, median of {args.calls} calls")
    for name, fn in programs.items():
        f = jax.jit(fn)
        f(x).block_until_ready()
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            f(x).block_until_ready()
            times.append(time.perf_counter() - t0)
        print(f"{name:<28} {statistics.median(times) * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
