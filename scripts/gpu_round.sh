#!/usr/bin/env bash
# One H200 call for this round's CUDA-path changes: the INT4 GPU tests (dense and MoE), Qwen3-8B
# INT4 (bench workload + batch-1 decode), speculative decoding on Qwen3-8B at batch 64, and
# Qwen3-30B-A3B INT4; a short table last. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_round}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
SKIP_KERNELS=1 SKIP_BF16=1 OUT="$OUT/int4" bash scripts/gpu_int4.sh > "$OUT/int4.txt" 2>&1
timeout 170 python3 benchmarks/spec_bench.py --dummy qwen3-8b --methods ngram eagle3 --synthetic 0.7 --k 4 \
  --batches 64 --kinds random --tokens 128 --json "$OUT/spec64.json" > "$OUT/spec64.log" 2>&1
timeout 150 python3 bench.py --dummy qwen3-30b-a3b --latency --quantization gptq --json "$OUT/moe-int4.json" \
  > "$OUT/moe-int4.log" 2>&1
echo "=== int4"; cat "$OUT/int4.txt"
echo "=== spec batch 64"; tail -8 "$OUT/spec64.log"
echo "=== qwen3-30b-a3b gptq"
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['output_tok_s'], 'bs1 ms', r.get('decode_ms_per_token_bs1'), 'floor', r.get('fraction_of_floor'))" \
  "$OUT/moe-int4.json" 2>/dev/null || tail -8 "$OUT/moe-int4.log"
