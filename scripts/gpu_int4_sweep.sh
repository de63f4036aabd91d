#!/usr/bin/env bash
# One device call: bench_w4a16.py --sweep at 32-256 rows, above 64 rows over tiles of 64 / 128
# rows and columns with K split 1-4 ways (SWEEP_SPLITS), then the four best launches per GEMM.
set -uo pipefail
cd "$(dirname "$0")/.."
D=${OUT:-/tmp/gpu_int4_sweep}; mkdir -p "$D"; export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
(cd benchmarks/kernels && OUT="$D" SWEEP_SPLITS=1 timeout 420 python3 bench_w4a16.py --m 32,64,96,128,192,256 --sweep) \
  > "$D/sweep.log" 2>&1 || tail -n 5 "$D/sweep.log"
python3 scripts/_sweep_table.py "$D/w4a16.json"
