#!/bin/bash
# 200 Mbit/s at 20871d4 (/tmp/wt22) and 5be5be3 (/tmp/wt22b), in turns: is herald's slower step at 5be5be3 the code or
# the host? (the probe's median of three is the only change between them that reaches a run)
O=/tmp/ex/r22b/ab
mkdir -p $O
for round in 1 2; do
  for wt in wt22 wt22b; do
    cd /tmp/$wt
    export PYTHONPATH=/tmp/$wt
    B=".venv/bin/python benchmarks/bench_bandwidth.py --steps 300"
    $B --world-sizes 2 --rates 200 --configs tw herald_defaults --repeats 3 --out $O/w2_${wt}_$round.json > $O/w2_${wt}_$round.log 2>&1
    $B --world-sizes 4 --rates 200 --configs stock herald_defaults --repeats 3 --out $O/w4_${wt}_$round.json > $O/w4_${wt}_$round.log 2>&1
  done
done
echo done > $O/DONE
