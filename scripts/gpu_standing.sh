#!/usr/bin/env bash
# One device call for where main stands against issue 39's targets (and 36's INT4 batch 1):
# the no-compile and kernel GPU tests, bench.py --latency on Qwen3-0.6B (bf16, FP8 cache) and
# Qwen3-8B (bf16, FP8 weights + cache), then the batch-1 attention sweep
# (scripts/gpu_batch1_attention.sh). Each step is skipped once the call nears its 10 minutes
# (BUDGET seconds, default 540). Logs and JSON under $OUT; a table last. Env: SKIP_TESTS,
# SKIP_ATTENTION, INT4=1 (Qwen3-8B GPTQ too).
set -uo pipefail
cd "$(dirname "$0")/.."
D=${OUT:-/tmp/gpu_standing}; mkdir -p "$D"; export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
BUDGET=${BUDGET:-540}
left() { [ $((BUDGET - SECONDS)) -gt "$1" ]; }  # at least $1 seconds left?
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$D/gpu.txt"
[ -z "${SKIP_TESTS:-}" ] && timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_no_compile_in_a_run.py \
  tests/test_kernels.py > "$D/tests.log" 2>&1
bench() {  # name need_s args...
  local name=$1 need=$2; shift 2
  left "$need" || { echo "$name skipped (time)"; return; }
  timeout "$need" python3 bench.py --latency --json "$D/$name.json" "$@" > "$D/$name.log" 2>&1 \
    || echo "$name failed: $(tail -n 3 "$D/$name.log")"
}
bench 0.6b 110 --dummy qwen3-0.6b
bench 0.6b-fp8kv 110 --dummy qwen3-0.6b --kv-cache-dtype fp8
bench 8b 140 --dummy qwen3-8b
bench 8b-fp8 140 --dummy qwen3-8b --quantization fp8 --kv-cache-dtype fp8
[ -n "${INT4:-}" ] && bench 8b-gptq 140 --dummy qwen3-8b --quantization gptq
[ -z "${SKIP_ATTENTION:-}" ] && left 130 && OUT="$D/attention" timeout 125 bash scripts/gpu_batch1_attention.sh > "$D/attention.log" 2>&1
echo "=== tests"; tail -n 3 "$D/tests.log"
echo "=== batch-1 attention"; grep -v -i warn "$D/attention.log" 2>/dev/null | tail -n 40 | cut -c1-150
python3 - "$D" <<'PY'
import json, os, sys
d = sys.argv[1]
print(f"{'run':<12}{'tok/s':>9}{'floor':>7}{'step fl':>8}{'bs1 ms':>8}{'cold s':>8}")
for n in ("0.6b", "0.6b-fp8kv", "8b", "8b-fp8", "8b-gptq"):
    p = f"{d}/{n}.json"
    if not os.path.exists(p):
        print(f"{n:<12} (none)"); continue
    r = json.load(open(p))
    print(f"{n:<12}{r['output_tok_s']:>9.0f}{r.get('fraction_of_floor') or 0:>7.3f}"
          f"{r.get('fraction_of_step_floor') or 0:>8.3f}{r.get('decode_ms_per_token_bs1') or 0:>8.3f}{r.get('cold_start_s') or 0:>8.2f}")
PY
