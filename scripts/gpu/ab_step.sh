#!/usr/bin/env bash
# A/B on the lent GPU, in one call: the DLRM step of herald hot replication with the files of an older
# commit ("old") and of this tree ("new"), interleaved between two stock runs (the lent machines' host is
# noisy: compare within a call); the first new and old runs also profiled with their timelines. Before the
# call, here (a file's path with / written as %, so any files can be swapped):
#   rm -rf .ab_old && mkdir .ab_old && for f in <files>; do git show <commit>:$f > .ab_old/$(echo $f | tr / %); done
# then carry .ab_old, and after install.sh: bash scripts/gpu/ab_step.sh   (-> $OUT/ab_*.json, prof tarball; keep
# the timelines out of the repository: the device tree limit. benchmarks/gpu_trace_phases.py summarises them;
# HOTROWS=1 and FULL=1 add pairs, below)
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
out=${OUT:-ab}; mkdir -p "$out" .ab_new
for f in .ab_old/*; do p=$(basename "$f" | tr % /); cp "$p" ".ab_new/$(basename "$f")"; done
swap() { for f in .ab_$1/*; do cp "$f" "$(basename "$f" | tr % /)"; done; }
ov="planner=herald pipeline=herald pipeline.scheduling=off planner.link_mbit=null"
run() { local id=$1 extra=$2; shift 2; python3 benchmarks/gpu_step_time.py --batch-sizes ${BATCHES:-2048 8192} $extra \
          --steps ${STEPS:-50} --warmup ${WARMUP:-10} \
          --overrides "$@" --out "$out/ab_$id.json" > "/tmp/ab_$id.log" 2>&1
        grep -o "B=[0-9]*.*ms/step median" "/tmp/ab_$id.log" | sed "s/^/$id /"
        grep -q "Error" "/tmp/ab_$id.log" && grep -v -i warn "/tmp/ab_$id.log" | tail -15; }
prof="--profile --trace"
run stock1 "$prof" planner=table_wise pipeline=sparse_dist
swap new; run new1 "$prof" $ov
swap old; run old1 "$prof" $ov
swap new; run new2 "" $ov
swap old; run old2 "" $ov
swap new; run stock2 "" planner=table_wise pipeline=sparse_dist
# HOTROWS=1: new and old with hot rows at one rank too (planner.selector=top_fraction: 2 % of each table
# replicated; the cost model replicates none at one rank, where no link is saved); FULL=1: herald full, new and old
hr="planner.selector=top_fraction"
[ -n "${HOTROWS:-}" ] && { swap new; run hotrows_new "" $ov $hr; swap old; run hotrows_old "" $ov $hr; }
full="planner=herald pipeline=herald pipeline.scheduling=on planner.link_mbit=null"
[ -n "${FULL:-}" ] && { swap new; run full_new "" $full; swap old; run full_old "" $full; }
swap new
(cd "$out" && tar czf ab_prof.tar.gz ab_*.prof.txt ab_*.trace.json.gz && rm -f ab_*.prof.txt ab_*.trace.json.gz)
