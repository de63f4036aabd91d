#!/usr/bin/env bash
# One device call for the INT4 tensor-core GEMM with x and the words by TMA (w4a16_mma.py's
# mma_tma_kernel) at 65-511 rows: the INT4 GPU exactness tests, then bench.py --latency on
# Qwen3-8B GPTQ for this tree and for
# AB_BASE (default .ab_base: a git archive of the commit before, carried), then bf16 for the
# ratio. Steps are skipped near the call's 10 minutes. Logs and JSON under $OUT; a table last.
set -uo pipefail
cd "$(dirname "$0")/.."
D=${OUT:-/tmp/gpu_int4_tma}; mkdir -p "$D"; export PYTHONUNBUFFERED=1
NEW=$PWD; BASE=$(cd "${AB_BASE:-.ab_base}" && pwd)
BUDGET=${BUDGET:-570}
left() { [ $((BUDGET - SECONDS)) -gt "$1" ]; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$D/gpu.txt"
PYTHONPATH=$NEW timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_int4.py tests/test_gpu.py \
  -k "${TESTS_K:-unpacks_exactly or w4a16}" > "$D/tests.log" 2>&1
bench() {  # name tree args...
  local name=$1 tree=$2; shift 2
  left 100 || { echo "$name skipped (time)"; return; }
  (cd "$tree" && PYTHONPATH=$tree timeout 110 python3 bench.py --dummy qwen3-8b --latency --json "$D/$name.json" "$@") \
    > "$D/$name.log" 2>&1 || echo "$name failed: $(tail -n 3 "$D/$name.log")"
}
bench gptq-tma "$NEW" --quantization gptq
bench gptq-base "$BASE" --quantization gptq
[ -z "${SKIP_BF16:-}" ] && bench bf16 "$NEW"
echo "=== tests"; tail -n 3 "$D/tests.log"
python3 - "$D" <<'PY'
import json, os, sys
d = sys.argv[1]
print(f"{'run':<10}{'tok/s':>9}{'bs1 ms':>8}{'cold s':>8}   ms/step by decode batch")
for n in ("bf16", "gptq-base", "gptq-tma"):
    p = f"{d}/{n}.json"
    r = json.load(open(p)) if os.path.exists(p) else None
    if not r:
        print(f"{n:<10} (none)"); continue
    steps = " ".join(f"{g['group'].replace('decode bs>=', '')}:{g['ms_per_step']:.2f}" for g in r.get("timeline", []) if g["group"].startswith("decode"))
    print(f"{n:<10}{r['output_tok_s']:>9.0f}{r.get('decode_ms_per_token_bs1') or 0:>8.3f}{r.get('cold_start_s') or 0:>8.2f}   {steps}")
PY
