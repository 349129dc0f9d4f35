#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu/install.sh: every GPU check and timing of issue 14, results
# into $OUT (the device tool's output folder) or ./gpu_results. Each step runs even if one before failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
out=${OUT:-gpu_results}; mkdir -p "$out"
step() { echo "=== $*"; local t0=$SECONDS; "$@"; echo "=== rc=$? in $((SECONDS - t0)) s: $1 $2"; }
step python3 scripts/gpu/probe_tbe.py --out "$out/gpu_probe.json" 2>&1 | grep -v -i "warn\|compat\|\[0m\|\[33m\|^ *$\|run_backward"
step python3 scripts/gpu/check_cuda_vs_cpu.py --out "$out/gpu_check.json" 2>&1 | grep -E "^(===|single|plan|per_step|all_pass)|Error"
export HERALD_RUN_ID=gpu_train
step python3 -m torchrec_herald.train planner=herald pipeline=herald compare_with=table_wise \
    data.num_train_batches=${TRAIN_BATCHES:-300} > "$out/gpu_train.log" 2>&1; tail -16 "$out/gpu_train.log"
python3 scripts/gpu/compare_runs.py outputs/gpu_train > "$out/gpu_train.json" && cat "$out/gpu_train.json" | head -30
cp outputs/gpu_train/training.png "$out/gpu_train_training.png" 2>/dev/null
step python3 benchmarks/gpu_step_time.py --batch-sizes 2048 8192 --out "$out/gpu_step_time.json" 2>&1 \
    | grep -E "ms/step|Error|==="
step python3 benchmarks/gpu_step_time.py --batch-sizes 2048 8192 --overrides planner=herald pipeline=herald \
    --out "$out/gpu_step_time_herald.json" 2>&1 | grep -E "ms/step|Error|==="
