#!/usr/bin/env bash
# One device call A/B-ing an INT4 kernel change: bench.py --latency on Qwen3-8B GPTQ for this tree
# and for AB_BASE (default .ab_base: a git archive of the commit before, carried), bf16 for the
# ratio (NO_BF16: none), with AB_THIRD a third tree's bench; the INT4 GPU tests; the INT4 GEMMs
# alone at choose's launches on both trees (bench_w4a16.py, GEMM_M rows); unless NO_TILES, the
# tile launches TILES (4-warp 128 x 64 against 8-warp 128 x 128 by default) at TILES_M rows on
# this tree; with PROBE=1 the TMA probe (w4a16_tma_probe.py, PROBE_M rows); with SWEEP=1 a sweep
# (SWEEP_M rows).
# Each step is skipped once the call nears its 10 minutes. Logs and JSON under $OUT; a table last.
set -uo pipefail
cd "$(dirname "$0")/.."
D=${OUT:-/tmp/gpu_int4}; mkdir -p "$D"; export PYTHONUNBUFFERED=1
NEW=$PWD; BASE=$(cd "${AB_BASE:-.ab_base}" && pwd)
BUDGET=${BUDGET:-560}
left() { [ $((BUDGET - SECONDS)) -gt "$1" ]; }  # at least $1 seconds left?
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$D/gpu.txt"
bench() {  # name tree args...
  local name=$1 tree=$2; shift 2
  left 150 || { echo "$name skipped (time)"; return; }
  (cd "$tree" && PYTHONPATH=$tree timeout 150 python3 bench.py --dummy qwen3-8b --latency --json "$D/$name.json" "$@") \
    > "$D/$name.log" 2>&1 || echo "$name failed: $(tail -n 3 "$D/$name.log")"
}
bench gptq-new "$NEW" --quantization gptq
bench gptq-base "$BASE" --quantization gptq
[ -z "${NO_BF16:-}" ] && bench bf16 "$NEW"
[ -n "${AB_THIRD:-}" ] && bench gptq-third "$(cd "$AB_THIRD" && pwd)" --quantization gptq
# (a cold machine compiles each test's kernels: ~150 s; warm ~80 s)
t=$((BUDGET - SECONDS - 170)); [ $t -lt 100 ] && t=100  # leaves the GEMMs ~170 s when there is time
left 100 && PYTHONPATH=$NEW timeout $t python3 -m pytest -q -m gpu -p no:cacheprovider -rf --tb=line \
  tests/test_int4.py tests/test_int4_moe.py tests/test_gpu.py -k "int4 or w4a16" > "$D/tests.log" 2>&1
gemm() {  # name tree
  left 80 && (cd "$2/benchmarks/kernels" && PYTHONPATH=$2 timeout 100 python3 bench_w4a16.py --m "${GEMM_M:-2,16,64,128,136,192,256}") \
    > "$D/$1.log" 2>&1
}
gemm gemm "$NEW"
gemm gemm-base "$BASE"
# tile launches at 129-256 rows, this tree (256-row tiles lost on 12-07: BENCHMARKS.md)
[ -z "${NO_TILES:-}" ] && left 70 && PYTHONPATH=$NEW timeout $((BUDGET - SECONDS - 10)) python3 benchmarks/kernels/bench_w4a16.py \
  --m "${TILES_M:-136,192,256}" --mma "${TILES:-128,64,64,1,4,4;128,128,64,1,8,4;128,128,64,1,8,3}" > "$D/tiles.log" 2>&1
[ -n "${PROBE:-}" ] && left 90 && (cd benchmarks/kernels && PYTHONPATH=$NEW timeout $((BUDGET - SECONDS - 15)) \
  python3 w4a16_tma_probe.py "${PROBE_M:-64,128,256}" 2> "$D/probe.err") > "$D/probe.log"
[ -n "${SWEEP:-}" ] && left 60 && (cd benchmarks/kernels && PYTHONPATH=$NEW timeout $((BUDGET - SECONDS - 15)) python3 bench_w4a16.py \
  --m "${SWEEP_M:-192,256}" --sweep) > "$D/sweep.log" 2>&1
echo "=== tests"; grep -v -i warn "$D/tests.log" | tail -n 6 | cut -c1-200
echo "=== GEMMs (choose's launch), this tree then AB_BASE"; grep -v -i warn "$D/gemm.log" | tail -n 29 | cut -c1-100
grep -v -i warn "$D/gemm-base.log" 2>/dev/null | tail -n 28 | cut -c1-100
[ -z "${NO_TILES:-}" ] && echo "=== launches at ${TILES_M:-136,192,256} rows, this tree" && grep -v -i warn "$D/tiles.log" | tail -n 36 | cut -c1-120
[ -n "${SWEEP:-}" ] && echo "=== sweep ${SWEEP_M:-192,256} rows" && grep -v -i warn "$D/sweep.log" | tail -n 9 | cut -c1-260
[ -n "${PROBE:-}" ] && { echo "=== TMA probe"; grep -v skip "$D/probe.log" | tail -n 12; }
python3 - "$D" <<'PY'
import json, os, sys
d = sys.argv[1]
print(f"{'run':<10}{'tok/s':>9}{'bs1 ms':>8}{'cold s':>8}  decode ms/step by rows (bench timeline)")
for n in ("bf16", "gptq-base", "gptq-new", "gptq-third"):
    p = f"{d}/{n}.json"
    r = json.load(open(p)) if os.path.exists(p) else None
    print(f"{n:<10}" + (f"{r['output_tok_s']:>9.0f}{r.get('decode_ms_per_token_bs1') or 0:>8.3f}{r.get('cold_start_s') or 0:>8.2f}"
                        if r else " (none)") + ("  " + ", ".join(f"{g['group'].replace('decode ', '')}: {g['ms_per_step']:.2f}"
                        for g in r["timeline"] if g["group"].startswith("decode")) if r else ""))
PY
