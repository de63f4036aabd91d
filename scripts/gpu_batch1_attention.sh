#!/usr/bin/env bash
# One device call for the batch-1 decode attention (BENCHMARKS.md "Batch-1 steps": ~6 us a layer
# for ~1.2 us of KV bytes at 1,000 tokens, a chain of dependent loads in one tile a program):
# the split kernel alone at one row, every split count, at three tile sizes, for Qwen3-0.6B's
# heads (16 q / 8 kv) and Qwen3-8B's (32 / 8) on a bf16 cache, then 8B's on an FP8 cache.
# Results under $OUT; the kernel's own table of each sweep is printed.
set -uo pipefail
cd "$(dirname "$0")/.."
D=${OUT:-/tmp/gpu_batch1_attention}; mkdir -p "$D"; export PYTHONUNBUFFERED=1
for tile in 16 32 64; do
  for group in 2 4; do
    echo "== tile $tile, $((group * 8)) query heads, bf16 cache"
    PYTHONPATH=. timeout 120 python3 benchmarks/kernels/bench_paged_decode.py --case 1,2,4:16:900-1100 \
      --group $group --kv-heads 8 --tile $tile --json "$D/b1-g$group-t$tile.json" 2>&1 | tail -n 4
  done
done
echo "== 8B heads, FP8 cache (default tile)"
PYTHONPATH=. timeout 120 python3 benchmarks/kernels/bench_paged_decode.py --case 1,2,4:16:900-1100 --group 4 \
  --kv-heads 8 --kv-fp8 --json "$D/b1-g4-fp8.json" 2>&1 | tail -n 4
