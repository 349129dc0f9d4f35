#!/bin/bash
# the speed targets and the model of time's points at this session's code (20871d4: the probe on its own group,
# the overlapped sums hidden behind compute alone), from a worktree at that commit
cd /tmp/wt22
export PYTHONPATH=/tmp/wt22
O=/tmp/ex/r22
B=".venv/bin/python benchmarks/bench_bandwidth.py --steps 300"
$B --world-sizes 2 --rates 200 50 --configs tw herald_defaults --repeats 3 --out $O/bw_w2_lim.json > $O/bw_w2_lim.log 2>&1
$B --world-sizes 4 --rates 200 50 --configs stock herald_defaults --repeats 3 --out $O/bw_w4_lim.json > $O/bw_w4_lim.log 2>&1
$B --world-sizes 2 --rates 0 --configs tw herald_defaults --repeats 5 --out $O/bw_w2_unl.json > $O/bw_w2_unl.log 2>&1
$B --world-sizes 4 --rates 0 --configs stock herald_defaults --repeats 5 --out $O/bw_w4_unl.json > $O/bw_w4_unl.log 2>&1
echo done > $O/DONE
