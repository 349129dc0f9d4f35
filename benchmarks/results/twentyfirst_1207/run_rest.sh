#!/bin/bash
# the rest at 79263be (completion times opt-in, the meter's exit waits for calls in flight)
cd /tmp/wt21b
export PYTHONPATH=/tmp/wt21b
O=/tmp/ex/r21
B=".venv/bin/python benchmarks/bench_bandwidth.py --steps 300"
$B --world-sizes 4 --rates 0 --configs hot_kept --repeats 3 --out $O/bw_w4_unl_hot.json > $O/bw_w4_unl_hot.log 2>&1
$B --world-sizes 4 --rates 200 50 --configs stock herald_defaults --repeats 3 --out $O/bw_w4_lim.json > $O/bw_w4_lim.log 2>&1
echo done > $O/REST_DONE
