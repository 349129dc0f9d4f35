#!/bin/bash
# the 2-rank points again at 515dc51 (peer wait counted from each rank's wait for the result), from a worktree
cd /tmp/wt24b
export PYTHONPATH=/tmp/wt24b
O=/tmp/ex/r24b
mkdir -p $O
B=".venv/bin/python benchmarks/bench_bandwidth.py --steps 300"
$B --world-sizes 2 --rates 0 --configs tw herald_defaults --repeats 5 --out $O/bw_w2_unl.json > $O/bw_w2_unl.log 2>&1
$B --world-sizes 2 --rates 0 --configs hot_kept sched_kept --repeats 3 --out $O/bw_w2_unl_herald.json > $O/bw_w2_unl_herald.log 2>&1
$B --world-sizes 2 --rates 200 50 --configs tw herald_defaults --repeats 3 --out $O/bw_w2_lim.json > $O/bw_w2_lim.log 2>&1
echo done > $O/DONE
