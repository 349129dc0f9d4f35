#!/bin/bash
# herald's own compute at the unlimited link (its plans forced: scheduling at 2 ranks, hot replication at 4), the
# model of time's inputs for herald's points, at the same code
cd /tmp/wt22
export PYTHONPATH=/tmp/wt22
O=/tmp/ex/r22
B=".venv/bin/python benchmarks/bench_bandwidth.py --steps 300"
$B --world-sizes 2 --rates 0 --configs hot_kept sched_kept --repeats 3 --out $O/bw_w2_unl_herald.json > $O/bw_w2_unl_herald.log 2>&1
$B --world-sizes 4 --rates 0 --configs hot_kept --repeats 3 --out $O/bw_w4_unl_hot.json > $O/bw_w4_unl_hot.log 2>&1
echo done > $O/HERALD_DONE
