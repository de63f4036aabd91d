#!/usr/bin/env bash
# INT4 weights on the H200 in one call: the GPU tests (kernel and checkpoints), the W4A16 GEMM
# against bf16 with its bandwidth (benchmarks/kernels/bench_w4a16.py), and Qwen3-8B bf16 against
# INT4 (dummy GPTQ, group 128): the bench workload and batch-1 decode. Results under $OUT.
#   bash scripts/gpu_int4.sh   (env: SKIP_TESTS, SKIP_KERNELS, SKIP_BENCH, SKIP_BF16, SWEEP=1, QUANT=gptq, MOE=1: Qwen3-30B-A3B INT4 too)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_int4}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
[ -z "${SKIP_TESTS:-}" ] && timeout 320 python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_int4_moe.py -k "w4a16 or int4" 2>&1 | tail -15 > "$OUT/tests.log"
[ -z "${SKIP_KERNELS:-}" ] && OUT="$OUT" timeout 200 python3 benchmarks/kernels/bench_w4a16.py ${SWEEP:+--sweep} > "$OUT/kernels.log" 2>&1
if [ -z "${SKIP_BENCH:-}" ]; then
  [ -z "${SKIP_BF16:-}" ] && timeout 150 python3 bench.py --dummy qwen3-8b --latency --json "$OUT/bench-bf16.json" \
    > "$OUT/bench-bf16.log" 2>&1
  timeout 150 python3 bench.py --dummy qwen3-8b --latency --quantization "${QUANT:-gptq}" --json "$OUT/bench-int4.json" \
    > "$OUT/bench-int4.log" 2>&1
  [ -n "${MOE:-}" ] && timeout 200 python3 bench.py --dummy qwen3-30b-a3b --latency --quantization "${QUANT:-gptq}" \
    --json "$OUT/bench-moe-int4.json" > "$OUT/bench-moe-int4.log" 2>&1
fi
echo "=== tests"; tail -4 "$OUT/tests.log" 2>/dev/null
echo "=== kernels"; grep -A40 "^gemm" "$OUT/kernels.log" 2>/dev/null || tail -20 "$OUT/kernels.log"
for f in bench-bf16 bench-int4 bench-moe-int4; do
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], r['output_tok_s'], 'bs1 ms', r.get('decode_ms_per_token_bs1'), r.get('quantization'), 'floor', r.get('fraction_of_floor'))" \
    "$OUT/$f.json" "$f" 2>/dev/null || { echo "=== $f"; tail -5 "$OUT/$f.log"; }
done
cd "$OUT" && tar -czf results.tgz *.log *.json 2>/dev/null && rm -f *.log *.json
