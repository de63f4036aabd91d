#!/usr/bin/env bash
# The feature checks on the H200 in one call: the feature benches first (their figures are what
# the issues ask for), then GPU tests: structured outputs (benchmarks/structured_bench.py, every
# request JSON-constrained vs none), with LORA_BENCH=1 multi-LoRA (benchmarks/lora_bench.py: the
# bench workload on 8 rank-16 adapters vs the base model), then pytest -m gpu over TESTS
# (default: tests) plus the LoRA kernel tests.
# Wheels the machine lacks (xgrammar, peft, jsonschema and their needs, cp312) travel in .whl/
# (git-ignored; named in the device call's carry), installed first when present, with
# qwen.tiktoken (from the dashscope wheel) for the structured bench's real vocabulary. Env:
# TEST_TIMEOUT (default 360 s), TESTS, PYTEST_ARGS, SKIP_TESTS=1, SKIP_STRUCTURED=1, STRUCTURED_BOTH=1 (the
# random BPE as well as the real tokens). Results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_features}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
if [ -z "${SKIP_STRUCTURED:-}" ]; then
  # Qwen's real tokens when .whl/qwen.tiktoken travelled (see structured_bench.py), else the random BPE
  VOCAB=$([ -f .whl/qwen.tiktoken ] && echo "--vocab-file .whl/qwen.tiktoken")
  timeout 200 python3 benchmarks/structured_bench.py --repeat ${REPEAT:-2} $VOCAB --json "$OUT/structured.json" \
    > "$OUT/structured.log" 2>&1
  if [ -n "$VOCAB" ] && [ -n "${STRUCTURED_BOTH:-}" ]; then  # the random BPE too, for the record
    timeout 200 python3 benchmarks/structured_bench.py --repeat 1 --json "$OUT/structured_random_bpe.json" \
      > "$OUT/structured_random_bpe.log" 2>&1
  fi
fi
if [ -n "${LORA_BENCH:-}" ]; then
  timeout 300 python3 benchmarks/lora_bench.py --dummy qwen3-8b --adapters 8 --json "$OUT/lora.json" > "$OUT/lora.log" 2>&1
fi
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_lora_kernels.py > "$OUT/pytest_lora_kernels.log" 2>&1
  timeout ${TEST_TIMEOUT:-360} python3 -m pytest -q -p no:cacheprovider -rfEs --durations=10 -m gpu ${TESTS:-tests} \
    ${PYTEST_ARGS:-} > "$OUT/pytest_gpu.log" 2>&1
fi
echo "=== structured"; grep -E "tok/s|ratio" "$OUT"/structured*.log 2>/dev/null | tail -8
echo "=== lora"; grep -E "tok/s|ratio|Error" "$OUT/lora.log" 2>/dev/null | tail -5
echo "=== lora kernels"; tail -1 "$OUT/pytest_lora_kernels.log" 2>/dev/null
echo "=== gpu tests"; grep -E "passed|failed|error|FAILED|ERROR" "$OUT/pytest_gpu.log" 2>/dev/null | tail -15
