#!/bin/bash
# the 2- and 4-rank points at d4d0af0 (the probe on a thread of its own with a deadline), from a worktree
cd /tmp/wt25
export PYTHONPATH=/tmp/wt25
O=/tmp/ex/r25
mkdir -p $O
B="flock /tmp/herald_cpu.lock .venv/bin/python benchmarks/bench_bandwidth.py --steps 300"
$B --world-sizes 2 --rates 0 --configs tw herald_defaults --repeats 5 --out $O/bw_w2_unl.json > $O/bw_w2_unl.log 2>&1
$B --world-sizes 2 --rates 0 --configs hot_kept sched_kept --repeats 3 --out $O/bw_w2_unl_herald.json > $O/bw_w2_unl_herald.log 2>&1
$B --world-sizes 2 --rates 200 50 --configs tw herald_defaults --repeats 3 --out $O/bw_w2_lim.json > $O/bw_w2_lim.log 2>&1
$B --world-sizes 4 --rates 0 --configs stock herald_defaults --repeats 5 --out $O/bw_w4_unl.json > $O/bw_w4_unl.log 2>&1
$B --world-sizes 4 --rates 0 --configs hot_kept --repeats 3 --out $O/bw_w4_unl_hot.json > $O/bw_w4_unl_hot.log 2>&1
$B --world-sizes 4 --rates 200 50 --configs stock herald_defaults --repeats 3 --out $O/bw_w4_lim.json > $O/bw_w4_lim.log 2>&1
echo done > $O/DONE
