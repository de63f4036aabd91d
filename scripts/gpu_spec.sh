#!/usr/bin/env bash
# Speculative decoding on the H200 in one call: its GPU tests, then the 8B latency table
# (bf16: n-gram, EAGLE-3, a 0.6B draft model; FP8: n-gram, EAGLE-3) at synthetic acceptance, the
# bench workload with and without n-gram drafting, n-gram's real acceptance on repeating prompts. Logs and JSON under $OUT; a short table last.
#   bash scripts/gpu_spec.sh   (env: SPEC_BATCHES, SPEC_TOKENS, SKIP_TESTS, SKIP_FP8, SKIP_BENCH, SKIP_REAL)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_spec}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
B=${SPEC_BATCHES:-1 4 16}
T=${SPEC_TOKENS:-128}
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 200 python3 -m pytest -q -m gpu tests/test_gpu.py -k "speculative" 2>&1 | tail -15 > "$OUT/tests.log"
fi
timeout 300 python3 benchmarks/spec_bench.py --dummy qwen3-8b --methods ngram eagle3 draft_model --synthetic 0.7 \
  --k 4 --batches $B --kinds random --tokens "$T" --json "$OUT/spec-8b.json" > "$OUT/spec-8b.log" 2>&1
if [ -z "${SKIP_FP8:-}" ]; then
  timeout 150 python3 benchmarks/spec_bench.py --dummy qwen3-8b --quantization fp8 --methods ngram eagle3 \
    --synthetic 0.7 --k 4 --batches 1 16 --kinds random --tokens "$T" --json "$OUT/spec-8b-fp8.json" \
    > "$OUT/spec-8b-fp8.log" 2>&1
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout 120 python3 bench.py --dummy qwen3-0.6b --json "$OUT/bench-plain.json" > "$OUT/bench-plain.log" 2>&1
  timeout 120 python3 bench.py --dummy qwen3-0.6b --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' \
    --json "$OUT/bench-ngram.json" > "$OUT/bench-ngram.log" 2>&1
fi
if [ -z "${SKIP_REAL:-}" ]; then  # n-gram with the acceptance it really gets on repeating prompts
  timeout 120 python3 benchmarks/spec_bench.py --dummy qwen3-8b --methods ngram --k 4 --batches 1 4 16 \
    --kinds repeating --tokens "$T" --json "$OUT/spec-8b-real.json" > "$OUT/spec-8b-real.log" 2>&1
fi
echo "=== tests"; cat "$OUT/tests.log" 2>/dev/null | tail -4
for f in spec-8b spec-8b-fp8 spec-8b-real; do echo "=== $f"; grep -A8 "ms/token" "$OUT/$f.log" || tail -5 "$OUT/$f.log"; done
for f in bench-plain bench-ngram; do
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], r['output_tok_s'], r.get('mean_accepted_length'))" \
    "$OUT/$f.json" "$f" 2>/dev/null || { echo "=== $f"; tail -3 "$OUT/$f.log"; }
done
