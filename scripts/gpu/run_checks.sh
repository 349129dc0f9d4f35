#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu/install.sh: the GPU checks and timings of issue 14, results into
# $OUT (the device tool's output folder) or ./gpu_results. Parts (default: all of them, in this order):
#   probe   herald's two fbgemm TBEs on CUDA vs CPU; gloo carrying CUDA tensors      -> gpu_probe.json
#   check   herald EBC / pipeline on CUDA vs CPU and vs stock (check_cuda_vs_cpu.py) -> gpu_check.json
#   train   python -m torchrec_herald.train, 1 CUDA rank, herald vs stock TABLE_WISE -> gpu_train.json
#   noise   the same with stock TABLE_WISE against itself (run-to-run spread on CUDA) -> gpu_noise.json
#   modes   herald's plan mode against herald's own per-step path, 1 CUDA rank  -> gpu_modes.json
#   sgd     the train part with EXACT_SGD (no Adagrad 1/sqrt(state) amplification) -> gpu_train_sgd.json
#   time    DLRM step time at local batch 2048 / 8192, stock and herald      -> gpu_step_time*.json
#   modes3  the same for stock TABLE_WISE, herald hot replication alone and herald full (scheduling on),
#           herald's plan kept (no link fallback), 5 more steps of each profiled -> gpu_step3_*.json, gpu_step3_prof.tar.gz
#   modes4  modes3 and herald hot replication with TorchRec's DDP for the dense layers (planner.dense_sync=ddp)
# One rank trains stock TABLE_WISE by default (nothing crosses a link); planner.link_mbit=null keeps herald's plan.
# Usage: bash scripts/gpu/run_checks.sh [probe] [check] [train] [noise] [time]
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
out=${OUT:-gpu_results}; mkdir -p "$out"
parts=${*:-probe check train noise time}
step() { echo "=== $*"; local t0=$SECONDS; "$@"; echo "=== rc=$? in $((SECONDS - t0)) s: $1 $2"; }
train_pair() {  # $1 run id, $2.. overrides: a compare_with run and its JSON summary
    local id=$1; shift
    HERALD_RUN_ID=$id step python3 -m torchrec_herald.train "$@" data.num_train_batches=${TRAIN_BATCHES:-300} \
        > "$out/$id.log" 2>&1; tail -14 "$out/$id.log"
    python3 scripts/gpu/compare_runs.py "outputs/$id" > "$out/$id.json" && grep -A8 loss_max "$out/$id.json"
}
for part in $parts; do case $part in
  probe) step python3 scripts/gpu/probe_tbe.py --out "$out/gpu_probe.json" 2>&1 \
             | grep -v -i "warn\|compat\|\[0m\|\[33m\|^ *$\|run_backward" ;;
  check) step python3 scripts/gpu/check_cuda_vs_cpu.py --out "$out/gpu_check.json" ${CASES:+--cases $CASES} 2>&1 \
             | grep -E "^(===|ebc_|dlrm_|all_pass)|Error" ;;
  train) train_pair gpu_train planner=herald pipeline=herald planner.link_mbit=null compare_with=table_wise
         cp outputs/gpu_train/training.png "$out/gpu_train_training.png" 2>/dev/null ;;
  noise) train_pair gpu_noise planner=table_wise compare_with=table_wise ;;
  modes) train_pair gpu_modes planner=herald pipeline=herald planner.link_mbit=null compare_with=herald ;;  # plan mode vs per-step path
  sgd)   train_pair gpu_train_sgd planner=herald pipeline=herald planner.link_mbit=null compare_with=table_wise optimizer=sgd ;;
  time)  step python3 benchmarks/gpu_step_time.py --batch-sizes 2048 8192 --out "$out/gpu_step_time.json" 2>&1 \
             | grep -E "ms/step|Error|==="
         step python3 benchmarks/gpu_step_time.py --batch-sizes 2048 8192 --overrides planner=herald pipeline=herald planner.link_mbit=null \
             --out "$out/gpu_step_time_herald.json" 2>&1 | grep -E "ms/step|Error|===" ;;
  modes3|modes4) ms=("stock planner=table_wise pipeline=sparse_dist"
             "hot planner=herald pipeline=herald pipeline.scheduling=off planner.link_mbit=null")
         [ $part = modes4 ] && ms+=("hot_ddp planner=herald pipeline=herald pipeline.scheduling=off planner.link_mbit=null planner.dense_sync=ddp")
         ms+=("full planner=herald pipeline=herald pipeline.scheduling=on planner.link_mbit=null")
         for m in "${ms[@]}"; do
           set -- $m; id=$1; shift
           step python3 benchmarks/gpu_step_time.py --batch-sizes 2048 8192 --overrides "$@" --profile \
               --out "$out/gpu_step3_$id.json" > "/tmp/gpu_step3_$id.log" 2>&1
           grep -E "ms/step|===" "/tmp/gpu_step3_$id.log"
           grep -q "Error" "/tmp/gpu_step3_$id.log" && grep -v -i warn "/tmp/gpu_step3_$id.log" | tail -25
         done
         (cd "$out" && tar czf gpu_step3_prof.tar.gz gpu_step3_*.prof.txt && rm gpu_step3_*.prof.txt) ;;
  *) echo "unknown part $part"; exit 2 ;;
esac; done
