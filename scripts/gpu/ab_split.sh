#!/usr/bin/env bash
# A/B on the lent GPU, in one call: herald hot replication's step with the hot/cold split of an older
# commit ("old") and of this tree ("new"), interleaved, between two stock runs (the lent machines' host is
# noisy: compare within a call). Before the call, here:
#   mkdir -p .ab_old && for f in torchrec_herald/ops/hot_cold.py torchrec_herald/sharding/hot_replicated.py; do
#     git show def4cd3:$f > .ab_old/$(basename $f); done
# then, after install.sh: bash scripts/gpu/ab_split.sh   (-> $OUT/ab_*.json, about 2 minutes)
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
out=${OUT:-ab}; mkdir -p $out .ab_new
cp torchrec_herald/ops/hot_cold.py torchrec_herald/sharding/hot_replicated.py .ab_new/
old() { cp .ab_old/hot_cold.py torchrec_herald/ops/; cp .ab_old/hot_replicated.py torchrec_herald/sharding/; }
new() { cp .ab_new/hot_cold.py torchrec_herald/ops/; cp .ab_new/hot_replicated.py torchrec_herald/sharding/; }
ov="planner=herald pipeline=herald pipeline.scheduling=off planner.link_mbit=null"
run() { local id=$1; shift; python3 benchmarks/gpu_step_time.py --batch-sizes 2048 8192 --overrides "$@" \
          --out $out/ab_$id.json 2>&1 | grep -o "B=[0-9]*.*ms/step median" | sed "s/^/$id /"; }
run stock1 planner=table_wise pipeline=sparse_dist
new; run new1 $ov
old; run old1 $ov
new; run new2 $ov
old; run old2 $ov
new; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run new_expseg $ov
run stock2 planner=table_wise pipeline=sparse_dist
