#!/usr/bin/env bash
# Validate the CuPy paths on a machine with a GPU, and record what ran where.
#
#   bash bench/gpu_check.sh OUTDIR tests   # environment, then the GPU tests
#   bash bench/gpu_check.sh OUTDIR bench   # environment, then the GPU benchmarks
#
# Expects python3 with CuPy, Numba, mpi4py and pytest, and mpiexec on PATH (the `mpich`
# wheel works: pip install mpich). Writes env.txt and tests.log or bench.log to OUTDIR.
set -uo pipefail
out=${1:?usage: gpu_check.sh OUTDIR tests|bench}
what=${2:?usage: gpu_check.sh OUTDIR tests|bench}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# mpiexec must come from the MPI that mpi4py was built with: a system Open MPI's own
# launcher (as root, oversubscribed) when mpi4py links Open MPI
if python3 -c "from mpi4py import MPI; import sys; sys.exit('Open MPI' not in MPI.Get_library_version())" \
    && [ -x /usr/bin/mpiexec ]; then
    export SPARSECOLL_MPIEXEC=/usr/bin/mpiexec OMPI_ALLOW_RUN_AS_ROOT=1 \
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
fi
MPIEXEC=${SPARSECOLL_MPIEXEC:-mpiexec}
PY=$(command -v python3)  # by path: a launcher may not keep PATH
{
    date -u
    nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    nproc
    python3 - <<'EOF'
import sys
import cupy, numba, numpy
from mpi4py import MPI
print("python", sys.version.split()[0], "numpy", numpy.__version__, "numba", numba.__version__)
print("cupy", cupy.__version__, "CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(),
      "driver", cupy.cuda.runtime.driverGetVersion())
print("device", cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
try:
    from cupy.cuda import nccl
    print("nccl", nccl.get_version())
except Exception as e:
    print("nccl: not available:", e)
print("MPI:", MPI.Get_library_version().splitlines()[0])
EOF
    echo "mpiexec: $MPIEXEC ($(command -v "$MPIEXEC"))"
} > "$out/env.txt" 2>&1

case "$what" in
tests)
    # the device-buffer tests (real CuPy here), every selection backend, the collectives
    # on device buffers under mpiexec at P = 1, 2, 3 and 4 (4 ranks share the GPU)
    SPARSECOLL_NPROCS=${SPARSECOLL_NPROCS:-1,2,3,4} timeout ${TEST_TIMEOUT:-560} \
        python3 -m pytest -q -rs -p no:cacheprovider \
        ${TESTS:-tests/test_gpu.py tests/test_select.py tests/test_osu.py tests/test_mpi.py} \
        -k "${TESTS_K:-gpu or cupy or select or osu or cuda}" > "$out/tests.log" 2>&1
    echo "pytest exit $?" >> "$out/tests.log"
    ;;
bench)
    {
        set -x
        timeout 150 python3 -m sparsecoll.benchmarks.gpu select -m 1M,25M,100M \
            --density 0.001,0.01
        timeout 150 "$MPIEXEC" -n 4 "$PY" -m sparsecoll.benchmarks.gpu allreduce -m 25M \
            --density 0.001,0.01
        timeout 60 "$MPIEXEC" -n 1 "$PY" -m sparsecoll.benchmarks.gpu allreduce -m 25M \
            --comm nccl
        timeout 150 python3 -m sparsecoll bench osu --np 4 -d cuda -m 1M:16M -c
        # GradientReducer.step on device gradients (docs/gpu.md, "Training step")
        timeout 150 python3 bench/gpu_step.py -m 100M
        timeout 150 "$MPIEXEC" -n 4 "$PY" bench/gpu_step.py -m 25M
    } > "$out/bench.log" 2>&1
    echo "exit $?" >> "$out/bench.log"
    ;;
*)
    echo "unknown: $what (tests or bench)" >&2
    exit 2
    ;;
esac
