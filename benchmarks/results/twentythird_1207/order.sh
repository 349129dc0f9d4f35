#!/bin/bash
# W=2 unlimited: herald's fallback vs TABLE_WISE, in both orders, 15 repeats each (is the 2 % a run-order effect?)
cd /tmp/wt23  # (a worktree at afb8269)
export PYTHONPATH=/tmp/wt23
O=/tmp/ex/r23
B=".venv/bin/python benchmarks/bench_bandwidth.py --steps 300"
$B --world-sizes 2 --rates 0 --configs herald_defaults tw --repeats 15 --out $O/order_h_first.json > $O/order_h_first.log 2>&1
$B --world-sizes 2 --rates 0 --configs tw herald_defaults --repeats 15 --out $O/order_tw_first.json > $O/order_tw_first.log 2>&1
echo done > $O/ORDER_DONE
