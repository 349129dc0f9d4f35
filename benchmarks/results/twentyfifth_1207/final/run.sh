#!/bin/bash
# the rate-limited points and the 2-rank unlimited ones again at fcd952a (gloo's probe on the caller's thread), from a worktree
cd /tmp/wt25
export PYTHONPATH=/tmp/wt25
O=/tmp/ex/r25f
mkdir -p $O
B="flock /tmp/herald_cpu.lock .venv/bin/python benchmarks/bench_bandwidth.py --steps 300"
$B --world-sizes 2 --rates 200 50 --configs tw herald_defaults --repeats 3 --out $O/bw_w2_lim.json > $O/bw_w2_lim.log 2>&1
$B --world-sizes 4 --rates 200 50 --configs stock herald_defaults --repeats 3 --out $O/bw_w4_lim.json > $O/bw_w4_lim.log 2>&1
$B --world-sizes 2 --rates 0 --configs tw herald_defaults --repeats 6 --out $O/bw_w2_unl.json > $O/bw_w2_unl.log 2>&1
echo done > $O/DONE
