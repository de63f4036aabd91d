#!/usr/bin/env bash
# Speculative decoding on the H200 in one call: its GPU tests, then the 8B latency table
# (bf16: n-gram, EAGLE-3, a 0.6B draft model; FP8: n-gram, EAGLE-3) at synthetic acceptance, the
# bench workload with and without n-gram drafting, n-gram's real acceptance on repeating prompts. Logs and JSON under $OUT; a short table last.
#   bash scripts/gpu_spec.sh   (env: SPEC_BATCHES, SPEC_TOKENS, SKIP_TESTS, SKIP_SPEC, SKIP_FP8, SKIP_BENCH,
#   BENCH_REPEAT, BENCH_EAGLE=1, SKIP_REAL)
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
if [ -z "${SKIP_SPEC:-}" ]; then
  timeout 300 python3 benchmarks/spec_bench.py --dummy qwen3-8b --methods ngram eagle3 draft_model --synthetic 0.7 \
    --k 4 --batches $B --kinds random --tokens "$T" --json "$OUT/spec-8b.json" > "$OUT/spec-8b.log" 2>&1
fi
if [ -z "${SKIP_FP8:-}" ]; then
  timeout 150 python3 benchmarks/spec_bench.py --dummy qwen3-8b --quantization fp8 --methods ngram eagle3 \
    --synthetic 0.7 --k 4 --batches 1 16 --kinds random --tokens "$T" --json "$OUT/spec-8b-fp8.json" \
    > "$OUT/spec-8b-fp8.log" 2>&1
fi
# The bench workload (0.6B, 256 requests) without and with drafting, sides alternating BENCH_REPEAT times.
NGRAM='{"method": "ngram", "num_speculative_tokens": 4}'
EAGLE='{"method": "eagle3", "model": "benchmarks/configs/qwen3-0.6b-eagle3", "num_speculative_tokens": 4}'
BENCHES=()
if [ -z "${SKIP_BENCH:-}" ]; then
  for r in $(seq 1 "${BENCH_REPEAT:-1}"); do
    for side in plain ngram ${BENCH_EAGLE:+eagle3}; do
      spec=(); [ "$side" = ngram ] && spec=(--speculative-config "$NGRAM"); [ "$side" = eagle3 ] && spec=(--speculative-config "$EAGLE")
      timeout 120 python3 bench.py --dummy qwen3-0.6b "${spec[@]}" --json "$OUT/bench-$side-$r.json" > "$OUT/bench-$side-$r.log" 2>&1
      BENCHES+=("bench-$side-$r")
    done
  done
fi
if [ -z "${SKIP_REAL:-}" ]; then  # n-gram with the acceptance it really gets on repeating prompts
  timeout 120 python3 benchmarks/spec_bench.py --dummy qwen3-8b --methods ngram --k 4 --batches 1 4 16 \
    --kinds repeating --tokens "$T" --json "$OUT/spec-8b-real.json" > "$OUT/spec-8b-real.log" 2>&1
fi
echo "=== tests"; cat "$OUT/tests.log" 2>/dev/null | tail -4
for f in spec-8b spec-8b-fp8 spec-8b-real; do
  [ -f "$OUT/$f.log" ] && { echo "=== $f"; grep -A8 "ms/token" "$OUT/$f.log" || tail -5 "$OUT/$f.log"; }
done
for f in "${BENCHES[@]}"; do
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); p=[g for g in r['timeline'] if g['group']=='prefill']
print(sys.argv[2], r['output_tok_s'], 'prefill s', p[0]['seconds'] if p else None, 'accepted', r.get('mean_accepted_length'))" \
    "$OUT/$f.json" "$f" 2>/dev/null || { echo "=== $f"; tail -3 "$OUT/$f.log"; }
done
cd "$OUT" && tar -czf results.tgz *.log *.json 2>/dev/null && rm -f *.log *.json  # (the device brings back at most 8 files)
