#!/bin/bash
# usage: makerun_loop.sh OUTDIR N [RUN_ARGS...]
cd /work/main
out=$1; n=$2; shift 2
mkdir -p $out
for i in $(seq 1 $n); do
  if [ $# -gt 0 ]; then
    flock /tmp/herald_cpu.lock make run RUN_ARGS="$*" > $out/log$i.txt 2>&1
  else
    flock /tmp/herald_cpu.lock make run > $out/log$i.txt 2>&1
  fi
  grep -a "^trainer/0 |" $out/log$i.txt | sed 's/^trainer\/0 //' > $out/run$i.md
  echo "$i $(grep -a 'samples/s' $out/run$i.md)" >> $out/ratios.txt
done
echo END >> $out/ratios.txt
