#!/bin/bash
cd /work/main
for i in 1 2 3 4 5 6; do
  for mode in eval noeval; do
    if [ $mode = eval ]; then ov=""; else ov="eval=false"; fi
    r=$(flock /tmp/herald_cpu.lock .venv/bin/python benchmarks/run_order.py /tmp/ex/roL_${mode}_$i $ov 2>/dev/null | tail -1)
    echo "$mode $i $r" >> /tmp/ex/ro_loop.out
    rm -rf /tmp/ex/roL_${mode}_$i
  done
done
echo END >> /tmp/ex/ro_loop.out
