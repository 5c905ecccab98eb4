#!/usr/bin/env bash
# Validate the CuPy paths on a machine with a GPU, and record what ran where.
#
#   bash bench/gpu_check.sh OUTDIR tests   # one-process device tests (selection, arrays, OSU)
#   bash bench/gpu_check.sh OUTDIR mpi     # the collectives on device buffers under mpiexec
#   bash bench/gpu_check.sh OUTDIR bench   # selection, allreduce (staged, NCCL) benchmarks
#   bash bench/gpu_check.sh OUTDIR step    # OSU suite with device buffers, GradientReducer.step
#
# Each step stays under 10 minutes (the device tool's limit for one command), so they run as
# separate calls; each writes env.txt and STEP.log to OUTDIR (e.g. $OUT on the device tool).
# PYTEST_ARGS adds options to the outer pytest of `tests` and `mpi` (e.g. "-n 8" with
# pytest-xdist: the launcher's mpiexec runs stay one pytest per rank).
# Expects python3 with CuPy, Numba, mpi4py, pytest and hypothesis, and the mpiexec of the MPI
# that mpi4py was built with: a system Open MPI's (found below), or on PATH, or the one a
# carried `mpich` wheel installed next to itself (pip install --target DIR puts it in DIR/bin).
set -uo pipefail
out=${1:?usage: gpu_check.sh OUTDIR tests|mpi|bench|step}
what=${2:?usage: gpu_check.sh OUTDIR tests|mpi|bench|step}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# mpiexec must come from the MPI that mpi4py was built with: a system Open MPI's own
# launcher (as root, oversubscribed) when mpi4py links Open MPI
if python3 -c "from mpi4py import MPI; import sys; sys.exit('Open MPI' not in MPI.Get_library_version())" \
    && [ -x /usr/bin/mpiexec ]; then
    export SPARSECOLL_MPIEXEC=/usr/bin/mpiexec OMPI_ALLOW_RUN_AS_ROOT=1 \
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
fi
if [ -z "${SPARSECOLL_MPIEXEC:-}" ] && ! command -v mpiexec > /dev/null; then
    IFS=: read -ra _site <<< "${PYTHONPATH:-}"
    for d in "${_site[@]}"; do  # e.g. PYTHONPATH=$PWD:/tmp/site after the carried wheels
        if [ -x "$d/bin/mpiexec" ]; then export SPARSECOLL_MPIEXEC=$d/bin/mpiexec; break; fi
    done
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
    # the device-buffer tests in one process (real CuPy here): selection on every backend,
    # arrays, coalescing, kernels, torch CUDA tensors; the OSU suite's own tests
    timeout ${TEST_TIMEOUT:-560} python3 -m pytest -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} \
        ${TESTS:-tests/test_gpu.py tests/test_select.py tests/test_osu.py} \
        -k "${TESTS_K:-gpu or cupy or select or osu or cuda or nvrtc}" > "$out/tests.log" 2>&1
    echo "pytest exit $?" >> "$out/tests.log"
    ;;
mpi)
    # the collectives on device buffers under mpiexec at P = 1, 2, 3 and 4 (ranks share the
    # GPU round-robin: P > 1 on one GPU stages through host memory)
    SPARSECOLL_NPROCS=${SPARSECOLL_NPROCS:-1,2,3,4} timeout ${TEST_TIMEOUT:-560} \
        python3 -m pytest -q -rs -p no:cacheprovider ${PYTEST_ARGS:-} tests/test_mpi.py \
        -k "${TESTS_K:-gpu or osu}" > "$out/mpi.log" 2>&1
    echo "pytest exit $?" >> "$out/mpi.log"
    ;;
bench)
    {
        set -x
        timeout 180 python3 -m sparsecoll.benchmarks.gpu select -m 1M,25M,100M \
            --density 0.001,0.01
        timeout 240 "$MPIEXEC" -n 4 "$PY" -m sparsecoll.benchmarks.gpu allreduce -m 25M \
            --density 0.001,0.01
        timeout 120 "$MPIEXEC" -n 1 "$PY" -m sparsecoll.benchmarks.gpu allreduce -m 25M \
            --comm nccl
    } > "$out/bench.log" 2>&1
    echo "exit $?" >> "$out/bench.log"
    ;;
step)
    {
        set -x
        timeout 200 python3 -m sparsecoll bench osu --np 4 -d cuda -m 1M:16M -c
        # GradientReducer.step on device gradients (docs/reports/gpu.md, "Training step")
        timeout 160 python3 bench/gpu_step.py -m 100M
        timeout 180 "$MPIEXEC" -n 4 "$PY" bench/gpu_step.py -m 25M
    } > "$out/step.log" 2>&1
    echo "exit $?" >> "$out/step.log"
    ;;
*)
    echo "unknown: $what (tests, mpi, bench or step)" >&2
    exit 2
    ;;
esac
