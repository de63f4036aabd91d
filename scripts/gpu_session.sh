#!/usr/bin/env bash
# A device call for whichever GPU comes: on an H200 the standing benches (scripts/gpu_standing.sh without
# its tests and attention sweep, with Qwen3-8B GPTQ); on another GPU the TMA probe of the INT4
# tensor-core GEMM (benchmarks/kernels/w4a16_tma_probe.py).
set -uo pipefail
cd "$(dirname "$0")/.."
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1); echo "$GPU"
if [[ "$GPU" == *H200* ]]; then
  SKIP_TESTS=1 SKIP_ATTENTION=1 INT4=1 BUDGET=560 bash scripts/gpu_standing.sh
else
  mkdir -p "${OUT:-/tmp}"
  (cd benchmarks/kernels && PYTHONPATH=$PWD/../.. timeout 540 python3 w4a16_tma_probe.py "${PROBE_M:-16,64,128,256}" \
    2> "${OUT:-/tmp}/probe.err") | grep -v "skip" | tail -n 40
fi
