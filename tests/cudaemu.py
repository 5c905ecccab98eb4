"""Run the CUDA C of sparsecoll's RawModule kernels on the CPU, for the fake CuPy.

``RawModule(code=...)`` compiles the source with g++ against ``cudaemu.h`` (each CUDA thread
a std::thread, one block at a time, __syncthreads a barrier, warp intrinsics a rendezvous
of the lanes in their mask that aborts on what CUDA leaves undefined) and its launches run
the kernels themselves, not the fake's numpy re-statements. Slow (a thread per CUDA
thread): for small vectors. ``SPARSECOLL_EMU_FLAGS`` adds compiler flags, e.g.
``-fsanitize=address`` (then run python with libasan in LD_PRELOAD) to catch out-of-bounds
accesses in tail tiles.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from typing import Any

import numpy as np

__all__ = ["RawModule", "available"]

_HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cudaemu.h")
_C_TYPES = {
    "unsigned char": (np.uint8, ctypes.c_uint8),
    "unsigned short": (np.uint16, ctypes.c_uint16),
    "unsigned int": (np.uint32, ctypes.c_uint32),
    "unsigned long long": (np.uint64, ctypes.c_uint64),
    "long long": (np.int64, ctypes.c_int64),
    "int": (np.int32, ctypes.c_int32),
}
_BUILD = os.path.join(tempfile.gettempdir(), f"sparsecoll-cudaemu-{os.getuid()}")


def available() -> bool:
    """Whether a C++ compiler is there to build the kernels."""
    return shutil.which("g++") is not None


def _params(src: str) -> dict[str, list[tuple[str, str, bool]]]:
    """Each kernel's parameters: (name, C type with typedefs resolved, is a pointer)."""
    defs = {b: a.strip() for a, b in re.findall(r"typedef\s+([\w ]+?)\s+(\w+);", src)}
    kernels = {}
    for name, params in re.findall(r"__global__\s+void\s+(\w+)\s*\(([^)]*)\)", src):
        ps = []
        for p in params.split(","):
            p = " ".join(p.replace("__restrict__", "").replace("const ", "").split())
            pointer = "*" in p
            words = p.replace("*", " ").split()
            ctype = " ".join(words[:-1])
            ps.append((words[-1], defs.get(ctype, ctype), pointer))
        kernels[name] = ps
    return kernels


def _build(src: str) -> tuple[Any, dict]:
    kernels = _params(src)
    launchers = []
    for name, ps in kernels.items():
        decl = ", ".join(f"{ct}{'*' if ptr else ''} {pn}" for pn, ct, ptr in ps)
        call = ", ".join(pn for pn, _, _ in ps)
        launchers.append(
            f'extern "C" void launch_{name}(unsigned grid, unsigned block, {decl}) '
            f"{{ emu::launch(grid, block, [=] {{ {name}({call}); }}); }}"
        )
    with open(_HEADER) as f:
        header = f.read()
    flags = ["-O1", *os.environ.get("SPARSECOLL_EMU_FLAGS", "").split()]
    full = header + "\n" + src + "\n" + "\n".join(launchers) + "\n"
    tag = hashlib.sha1((full + " ".join(flags)).encode()).hexdigest()[:16]
    os.makedirs(_BUILD, exist_ok=True)
    lib = os.path.join(_BUILD, f"kernels_{tag}.so")
    if not os.path.exists(lib):
        cpp = os.path.join(_BUILD, f"kernels_{tag}.cpp")
        with open(cpp, "w") as f:
            f.write(full)
        cmd = ["g++", "-std=c++17", "-shared", "-fPIC", "-pthread", "-Wno-unknown-pragmas"]
        subprocess.run([*cmd, *flags, cpp, "-o", lib + ".tmp"], check=True)
        os.replace(lib + ".tmp", lib)
    return ctypes.CDLL(lib), kernels


class RawModule:
    """``cupy.RawModule`` whose kernels run on CPU threads; arguments are checked against
    the C signature as a GPU would need them (array element types, scalar widths)."""

    def __init__(self, code: str = "", options: tuple = (), **kwargs: Any) -> None:
        self._lib, self._kernels = _build(code)

    def get_function(self, name: str) -> Any:
        fn = getattr(self._lib, f"launch_{name}")
        params = self._kernels[name]

        def launch(grid: tuple, block: tuple, args: tuple, **kwargs: Any) -> None:
            from . import fakecupy

            if len(grid) != 1 or len(block) != 1 or len(args) != len(params):
                raise TypeError(f"{name}: grid {grid}, block {block}, {len(args)} arguments")
            cargs: list[Any] = [ctypes.c_uint(int(grid[0])), ctypes.c_uint(int(block[0]))]
            for a, (pname, ctype, pointer) in zip(args, params):
                want, cty = _C_TYPES[ctype]
                if pointer:
                    arr = a._a if isinstance(a, fakecupy.ndarray) else None
                    ok = arr is not None and arr.flags.c_contiguous
                    ok = ok and (arr.dtype == want or (want is np.uint8 and arr.dtype == bool))
                    if not ok:
                        raise TypeError(f"{name}: {pname} must be a contiguous {ctype} array")
                    cargs.append(ctypes.c_void_p(arr.ctypes.data))
                else:
                    if not isinstance(a, np.generic) or a.dtype != want:
                        raise TypeError(f"{name}: {pname} must be a numpy {ctype}, got {a!r}")
                    cargs.append(cty(a.item()))
            fn(*cargs)

        return launch
