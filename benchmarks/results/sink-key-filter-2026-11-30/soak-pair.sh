#!/bin/bash
cd /work/main
echo "== filter $(date -u +%H:%M:%S)"
.venv/bin/python benchmarks/bench_soak.py --minutes 1 --share 0.8 --probe-s 180 --probe-rate 8000 --out benchmarks/results/sink-key-filter-2026-11-30/pair-2-filter
pkill -9 -f EngineCore
echo "== lookup $(date -u +%H:%M:%S)"
LIVERL_WAREHOUSE__REMEMBER_KEYS=false .venv/bin/python benchmarks/bench_soak.py --minutes 1 --share 0.8 --probe-s 180 --probe-rate 8000 --out benchmarks/results/sink-key-filter-2026-11-30/pair-2-lookup
pkill -9 -f EngineCore
echo "== done $(date -u +%H:%M:%S)"
