#!/bin/bash
# the 4-rank points again at cb3afd2 (each run's peer wait counted from each rank's wait, as the 2-rank runs'), from a worktree
cd /tmp/wt24c
export PYTHONPATH=/tmp/wt24c
O=/tmp/ex/r24d
mkdir -p $O
B=".venv/bin/python benchmarks/bench_bandwidth.py --steps 300"
$B --world-sizes 4 --rates 0 --configs stock herald_defaults --repeats 5 --out $O/bw_w4_unl.json > $O/bw_w4_unl.log 2>&1
$B --world-sizes 4 --rates 0 --configs hot_kept --repeats 3 --out $O/bw_w4_unl_hot.json > $O/bw_w4_unl_hot.log 2>&1
$B --world-sizes 4 --rates 200 50 --configs stock herald_defaults --repeats 3 --out $O/bw_w4_lim.json > $O/bw_w4_lim.log 2>&1
echo done > $O/DONE
