#!/usr/bin/env bash
# Re-run every measurement behind docs/reports/benchmarks.md; CSVs, logs and figures go to OUT.
# Needs root for the emulated cluster (network namespaces, tc). 15-45 minutes, by load.
#   bench/run_tables.sh [OUT=docs/reports/data] [STEPS="emu fresh shm sweep model plot"]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-docs/reports/data}"
steps="${2:-emu fresh shm sweep model plot}"
py="${PYTHON:-python}"
n=25557032   # ResNet-50's parameter count: one float32 gradient
common=(-i 3 -x 1 -c -q --format csv --reuse)
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

run() { echo "+ $* # load: $(cut -d' ' -f1-3 /proc/loadavg)" >&2; "$@"; }

for step in $steps; do
  case "$step" in
    sweep)  # shared memory, P = 4, every algorithm, n = 1M..64M (in parts of a few minutes)
      rm -f "$out/shm_sweep_p4.csv"
      for m in 1M:8M 16M:32M 64M; do
        run "$py" -m sparsecoll bench osu --np 4 -m "$m" "${common[@]}" >"$out/part.csv"
        if [ -s "$out/shm_sweep_p4.csv" ]; then tail -n +2 "$out/part.csv"; else cat "$out/part.csv"; fi \
          >>"$out/shm_sweep_p4.csv"
      done
      rm -f "$out/part.csv" ;;
    shm)    # shared memory at the model's sizes (4096: latency-bound; n: bandwidth-bound)
      for p in 1 2 4 8; do
        run "$py" -m sparsecoll bench osu --np "$p" -m "4096,$n" "${common[@]}" >"$out/shm_p$p.csv"
      done ;;
    emu)    # emulated 1 Gbit/s cluster, one rank per host
      for p in 2 4 8; do
        run "$py" bench/emulate_cluster.py -n "$p" --rate 1gbit -- \
          "$py" -m sparsecoll bench osu -m "4096,$n" "${common[@]}" \
          >"$out/emu_1gbit_p$p.csv" 2>"$out/emu_1gbit_p$p.log"
        grep '^\[emulate\]' "$out/emu_1gbit_p$p.log" | grep -v running >&2
      done ;;
    fresh)  # the same at P = 4 without --reuse: stateful algorithms recompute every call
      run "$py" bench/emulate_cluster.py -n 4 --rate 1gbit -- \
        "$py" -m sparsecoll bench osu -m "$n" -i 3 -x 1 -c -q --format csv \
        --algorithm oktopk,gtopk,exdyna,auto >"$out/emu_1gbit_p4_fresh.csv" 2>/dev/null ;;
    model)
      run "$py" bench/project_model.py --shm "$out"/shm_p?.csv --emulated "$out"/emu_1gbit_p?.csv \
        --emu-logs "$out"/emu_1gbit_p?.log --emu-rate 1gbit >"$out/model.md" ;;
    plot)
      run "$py" bench/plot_osu.py "$out/shm_sweep_p4.csv" -o "$out/shm" --title "shared memory"
      run "$py" bench/plot_osu.py "$out"/emu_1gbit_p?.csv -o "$out/emu" --title "1 Gbit/s" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
