#!/bin/bash
# the hot set priced with the all-reduce rate (HEAD of this worktree): the rate-limited targets again
cd /tmp/wt21c
export PYTHONPATH=/tmp/wt21c
O=/tmp/ex/r21c
B=".venv/bin/python benchmarks/bench_bandwidth.py --steps 300"
$B --world-sizes 2 --rates 200 50 --configs tw herald_defaults --repeats 3 --out $O/bw_w2_lim.json > $O/bw_w2_lim.log 2>&1
$B --world-sizes 4 --rates 200 50 --configs stock herald_defaults --repeats 3 --out $O/bw_w4_lim.json > $O/bw_w4_lim.log 2>&1
echo done > $O/DONE
