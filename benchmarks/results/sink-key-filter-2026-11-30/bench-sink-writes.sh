#!/bin/bash
cd /work/main
mkdir -p /tmp/sinkb
for i in 1 2 3; do
  for m in --remember-keys --look-up-every-key; do
    echo "== phases $m run $i $(date -u +%H:%M:%S)"
    .venv/bin/python benchmarks/bench_sink_writes.py --phases $m
  done
done
for m in --remember-keys --look-up-every-key; do
  echo "== stored $m $(date -u +%H:%M:%S)"
  .venv/bin/python benchmarks/bench_sink_writes.py --stored 1000000 --stored 10000000 $m
done
echo "== done $(date -u +%H:%M:%S)"
