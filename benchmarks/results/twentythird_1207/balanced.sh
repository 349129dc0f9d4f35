#!/bin/bash
# 2 ranks, unlimited link, 6 repeats (each side first in 3), three times, from a worktree at 4faa8c3 (the order
# rotating); then make run five times in /work/main
cd /tmp/wt23b
export PYTHONPATH=/tmp/wt23b
O=/tmp/ex/r23c
B=".venv/bin/python benchmarks/bench_bandwidth.py --steps 300"
for i in 1 2 3; do
  flock /tmp/herald_cpu.lock $B --world-sizes 2 --rates 0 --configs tw herald_defaults --repeats 6 --out $O/bal_w2_unl_$i.json > $O/bal_w2_unl_$i.log 2>&1
done
/work/main/benchmarks/results/twentieth_1207/make_run_turns/makerun_loop.sh $O/make_run 5
echo done > $O/DONE
