#!/bin/bash
# the targets and the model of time's points at 8758d8d (each run's wait for its peers recorded), the order
# rotating from repeat to repeat, from a worktree at that commit
cd /tmp/wt24
export PYTHONPATH=/tmp/wt24
O=/tmp/ex/r24
mkdir -p $O
B=".venv/bin/python benchmarks/bench_bandwidth.py --steps 300"
$B --world-sizes 2 --rates 0 --configs tw herald_defaults --repeats 5 --out $O/bw_w2_unl.json > $O/bw_w2_unl.log 2>&1
$B --world-sizes 2 --rates 0 --configs hot_kept sched_kept --repeats 3 --out $O/bw_w2_unl_herald.json > $O/bw_w2_unl_herald.log 2>&1
$B --world-sizes 2 --rates 200 50 --configs tw herald_defaults --repeats 3 --out $O/bw_w2_lim.json > $O/bw_w2_lim.log 2>&1
$B --world-sizes 4 --rates 0 --configs stock herald_defaults --repeats 5 --out $O/bw_w4_unl.json > $O/bw_w4_unl.log 2>&1
$B --world-sizes 4 --rates 0 --configs hot_kept --repeats 3 --out $O/bw_w4_unl_hot.json > $O/bw_w4_unl_hot.log 2>&1
$B --world-sizes 4 --rates 200 50 --configs stock herald_defaults --repeats 3 --out $O/bw_w4_lim.json > $O/bw_w4_lim.log 2>&1
echo done > $O/DONE
