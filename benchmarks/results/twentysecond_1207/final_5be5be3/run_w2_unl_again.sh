#!/bin/bash
# 2 ranks, unlimited link, twice more at 5be5be3 (the first run's median 0.930x, both sides TABLE_WISE)
cd /tmp/wt22b
export PYTHONPATH=/tmp/wt22b
O=/tmp/ex/r22b
B=".venv/bin/python benchmarks/bench_bandwidth.py --steps 300"
for i in 2 3; do
$B --world-sizes 2 --rates 0 --configs tw herald_defaults --repeats 5 --out $O/bw_w2_unl_$i.json > $O/bw_w2_unl_$i.log 2>&1
done
echo done > $O/DONE2
