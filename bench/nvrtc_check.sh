#!/usr/bin/env bash
# Compile sparsecoll's CUDA kernels for sm_90 with NVRTC, on a machine without a GPU.
#
#   bash bench/nvrtc_check.sh [DIR]     # DIR: where the wheels go (default /tmp/sparsecoll-nvrtc)
#
# Installs the cupy-cuda12x and nvidia-cuda-nvrtc-cu12 wheels into DIR (not into the
# environment: with CuPy importable, the test suite would try the real device paths), then
# runs the compile tests of tests/test_gpu.py with DIR on PYTHONPATH: the selection
# kernels' source for every key and index width, and every ElementwiseKernel as CuPy itself
# generates it, and that one's PTX under CuPy's -ftz=true (no flushing float32 arithmetic).
# This catches a kernel that does not compile; only a GPU runs them.
set -euo pipefail
dir=${1:-/tmp/sparsecoll-nvrtc}
if [ ! -d "$dir/cupy_backends" ]; then
    python -m pip install -q --no-deps --target "$dir" cupy-cuda12x nvidia-cuda-nvrtc-cu12 \
        cuda-pathfinder
fi
LD_LIBRARY_PATH="$dir/nvidia/cuda_nvrtc/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" \
    python -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py \
    -k "test_kernel_sources_compile_with_nvrtc or test_kernels_compile_as_cupy_generates_them or test_kernels_keep_float32_subnormals"
