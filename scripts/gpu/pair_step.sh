#!/usr/bin/env bash
# On the lent GPU, after scripts/gpu/install.sh: herald's 1-rank step against stock TABLE_WISE's, each pair
# built in one process with their steps interleaved (benchmarks/gpu_step_time.py --baseline: the lent hosts
# drift by tens of percent between runs, more than the differences measured). Results into $OUT (or ./gpu_results).
# With .ab_old carried (as for ab_step.sh), OLD=1 also measures the older files' hot replication, same protocol.
# Parts, each under its own time limit so that the results always come back:
#   hot      herald hot replication (the cost model's plan: at one rank it replicates no rows)
#   nothread the same with its input dist on the training thread (planner.input_dist_thread=off)
#   ddp      the same with the dense layers under DDP (planner.dense_sync=ddp): the forward-ordered dense sync
#            runs a sum, a flatten and a division per layer group and its optimizer in the next forward, in
#            Python; on this CPU at B=16 the two stepped alike (1.13-1.15x vs 1.10-1.16x stock)
#   old      the same with the older files (OLD=1)
#   hotrows  hot replication with 2 % of each table replicated (planner.selector=top_fraction)
#   full     herald full (scheduling on), fed as the trainer feeds it (gpu_step_time.py --loader stream: a TrainStream,
#            so herald schedules whole global batches on its run-ahead thread)
#   fullown  the same fed this rank's batches by a plain iterator, as a TorchRec user's own loader (--loader own):
#            scores and reads gathered, samples moved, scheduled ahead; with pipeline.run_ahead=false on the
#            training thread, the order of every GPU figure of herald full up to 2026-11-27 (part fullserial)
#   two      hot replication at 2 ranks on the one GPU (torchrun; gloo carries the CUDA tensors), rank 0's pair
#   twofull  herald full the same way: the plan executor's reduce and stores on CUDA tensors (its in-order add is
#            index_put_(accumulate=True) there, a path no CPU run takes), rank 0's pair
#   prof     hot replication and stock profiled (kernel launches, host syncs, timelines), 5 steps each, and their
#            host time per pipeline phase side by side (benchmarks/gpu_trace_phases.py -> prof_phases.json).
#            The cProfile part of each .prof.txt covers every thread on Python 3.12 (the GPU host's): with the
#            input dist's worker thread on, its functions appear beside the training thread's
#   proffull herald full profiled the same way (its host syncs a step: the plan executor's copies of the host's
#            plans to the GPU are non-blocking since 2026-11-27, ninth session; before, each synchronised the stream)
#   check    CUDA against CPU and stock, one rank, herald's own per-step path (check_cuda_vs_cpu.py)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
out=${OUT:-gpu_results}; mkdir -p "$out"
stock="planner=table_wise pipeline=sparse_dist"
hot="planner=herald pipeline=herald pipeline.scheduling=off planner.link_mbit=null"
pair() { local id=$1; shift  # (LAUNCH: what runs the script, python3 unless a part says otherwise)
  timeout ${LIMIT:-90} ${LAUNCH:-python3} benchmarks/gpu_step_time.py --batch-sizes ${BATCHES:-2048 8192} --warmup 10 \
      --rounds ${ROUNDS:-10} --block ${BLOCK:-10} --loader ${LOADER:-stream} --overrides "$@" --baseline $stock --out "$out/pair_$id.json" \
      > "/tmp/pair_$id.log" 2>&1
  grep -o "B=[0-9]* .*" "/tmp/pair_$id.log" | sed "s/planner=table_wise pipeline=sparse_dist/stock/; s/^/$id /"
  grep -q "Error" "/tmp/pair_$id.log" && grep -v -i warn "/tmp/pair_$id.log" | tail -12; }
for part in ${PARTS:-hot nothread old full two hotrows check prof}; do case $part in
  hot) pair hot $hot ;;
  nothread) pair nothread $hot planner.input_dist_thread=off ;;
  ddp) pair ddp $hot planner.dense_sync=ddp ;;
  old) [ -n "${OLD:-}" ] || continue
       mkdir -p .ab_new; for f in .ab_old/*; do p=$(basename "$f" | tr % /); cp "$p" ".ab_new/$(basename "$f")"; cp "$f" "$p"; done
       pair old_hot $hot
       for f in .ab_new/*; do cp "$f" "$(basename "$f" | tr % /)"; done ;;
  hotrows) pair hotrows $hot planner.selector=top_fraction ;;
  full) pair full planner=herald pipeline=herald pipeline.scheduling=on planner.link_mbit=null ;;
  fullown) LOADER=own pair fullown planner=herald pipeline=herald pipeline.scheduling=on planner.link_mbit=null ;;
  fullserial) LOADER=own pair fullserial planner=herald pipeline=herald pipeline.scheduling=on planner.link_mbit=null \
                  pipeline.run_ahead=false ;;
  two) HERALD_DIST_BACKEND=gloo LAUNCH="python3 -m torch.distributed.run --standalone --nproc_per_node 2" pair two $hot ;;
  twofull) HERALD_DIST_BACKEND=gloo LAUNCH="python3 -m torch.distributed.run --standalone --nproc_per_node 2" \
             pair twofull planner=herald pipeline=herald pipeline.scheduling=on planner.link_mbit=null ;;
  prof) for id in hot stock; do [ $id = hot ] && cfg=$hot || cfg=$stock
          timeout ${LIMIT:-90} python3 benchmarks/gpu_step_time.py --batch-sizes 2048 --steps 20 --overrides $cfg \
              --profile --trace --out "$out/prof_$id.json" > /tmp/prof_$id.log 2>&1
          grep -o "B=[0-9]*.*ms/step median" /tmp/prof_$id.log | sed "s/^/prof $id /"; done
        python3 benchmarks/gpu_trace_phases.py "$out/prof_hot_B2048.prof.trace.json.gz" \
            "$out/prof_stock_B2048.prof.trace.json.gz" --out "$out/prof_phases.json" ;;
  proffull) timeout ${LIMIT:-90} python3 benchmarks/gpu_step_time.py --batch-sizes 2048 8192 --steps 20 \
                --overrides planner=herald pipeline=herald pipeline.scheduling=on planner.link_mbit=null \
                --profile --out "$out/prof_full.json" > /tmp/prof_full.log 2>&1
            grep -o "B=[0-9]*.*ms/step median" /tmp/prof_full.log | sed "s/^/proffull /"
            python3 -c "import json, sys; [print('proffull B=%d host syncs a step:' % r['local_batch'], r.get('host_syncs_per_step'))
                        for r in json.load(open(sys.argv[1]))['runs']]" "$out/prof_full.json" ;;
  check) OUT=$out CASES=${CASES:-ebc_single_no_hot sparse_dist} timeout ${LIMIT:-90} \
             bash scripts/gpu/run_checks.sh check ;;
  *) echo "unknown part $part"; exit 2 ;;
esac; done
