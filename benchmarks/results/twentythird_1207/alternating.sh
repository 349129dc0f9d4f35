#!/bin/bash
# the unlimited-link targets with the order alternating from repeat to repeat (4faa8c3): 2 ranks three times, 4 once
cd /tmp/wt23b  # (a worktree at 4faa8c3)
export PYTHONPATH=/tmp/wt23b
O=/tmp/ex/r23b
B=".venv/bin/python benchmarks/bench_bandwidth.py --steps 300"
for i in 1 2 3; do
  $B --world-sizes 2 --rates 0 --configs tw herald_defaults --repeats 5 --out $O/alt_w2_unl_$i.json > $O/alt_w2_unl_$i.log 2>&1
done
$B --world-sizes 4 --rates 0 --configs stock herald_defaults --repeats 5 --out $O/alt_w4_unl.json > $O/alt_w4_unl.log 2>&1
echo done > $O/DONE
