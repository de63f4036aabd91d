#!/usr/bin/env bash
# Everything that needs the GPU, in one command (made for one call on the H200):
#   bash scripts/gpu_suite.sh [bench args...]
# Env: BENCH_ARGS (single-GPU benches), TP_BENCH_ARGS (the TP=2 bench), TP_AB_ARGS (a second TP=2
# bench with these flags instead, e.g. --gather-logits), SKIP_TP1=1 (TP=2 benches only), PROFILE_STARTUP=1,
# KERNEL_BENCHES=1 (the kernel microbenchmarks: paged-decode split sweep (bf16 and FP8 KV) and row order, cuBLAS vs
# cuBLASLt decode GEMMs, FP8 GEMMs, the fused KV store, fused all-reduce vs NCCL, prefill all-reduce overlap;
# benchmarks/kernels/),
# LOGPROBS_BENCH=K (the 0.6B bench again with every request asking for K logprobs: their cost),
# SERVE_BENCH=1 (benchmarks/serve_bench.py on Qwen3-0.6B, 64 streaming clients: throughput against offline,
# TTFT / ITL, and the engine's step gaps by kind from the server's --step-log; SERVE_ARGS: more serve_bench flags,
# e.g. "--closed-loop --profile \$OUT"),
# PYTEST_ARGS, TEST_TIMEOUT; SKIP_BENCH=1 or SKIP_TESTS=1 to split the suite over two calls when
# one would outlast the device's 10-minute limit.
# 1. bench.py on dummy Qwen3-0.6B and Qwen3-8B shapes, 2. the GPU tests (pytest -m gpu).
# Logs and JSON are written to a scratch folder and packed into $OUT/gpu_suite.tgz (default OUT:
# /tmp/gpu_suite), with the printed table in $OUT/summary.txt: the device tool brings back at most
# 8 files of $OUT. A short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${OUT:-/tmp/gpu_suite}
OUT=$(mktemp -d /tmp/gpu_suite_logs.XXXXXX)
mkdir -p "$DEST"
trap 'tar -czf "$DEST/gpu_suite.tgz" -C "$OUT" . ; cp "$OUT/summary.txt" "$DEST/" 2>/dev/null' EXIT
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

# Benchmarks first: they are short and their numbers are what BENCHMARKS.md records.
if [ -z "${SKIP_BENCH:-}" ]; then
for m in $([ -z "${SKIP_TP1:-}" ] && echo qwen3-0.6b qwen3-8b); do
  timeout 300 python3 bench.py --dummy "$m" --latency ${BENCH_ARGS:-} --json "$OUT/bench-$m.json" "$@" 2>&1 | tee "$OUT/bench-$m.log"
done

if [ -n "${LOGPROBS_BENCH:-}" ]; then
  timeout 300 python3 bench.py --dummy qwen3-0.6b --logprobs "$LOGPROBS_BENCH" ${BENCH_ARGS:-} \
    --json "$OUT/bench-qwen3-0.6b-logprobs.json" "$@" 2>&1 | tee "$OUT/bench-qwen3-0.6b-logprobs.log"
fi

if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  timeout 300 python3 bench.py --dummy qwen3-8b --tp 2 ${TP_BENCH_ARGS:-} --json "$OUT/bench-qwen3-8b-tp2.json" "$@" 2>&1 \
    | tee "$OUT/bench-qwen3-8b-tp2.log"
  if [ -n "${TP_AB_ARGS:-}" ]; then  # the same TP=2 run with other flags, for an A/B in one call
    timeout 300 python3 bench.py --dummy qwen3-8b --tp 2 $TP_AB_ARGS --json "$OUT/bench-qwen3-8b-tp2-b.json" "$@" 2>&1 \
      | tee "$OUT/bench-qwen3-8b-tp2-b.log"
  fi
fi
fi

if [ -n "${SERVE_BENCH:-}" ]; then  # the OpenAI server under 64 streaming clients, against offline generate
  timeout 400 python3 benchmarks/serve_bench.py --dummy qwen3-0.6b --clients 64 --requests 256 --timeout 180 \
    --startup-timeout 90 --out "$OUT/serve.json" ${SERVE_ARGS:-} \
    $([ -n "${SERVE_PROFILE:-}" ] && echo --closed-loop --profile "$OUT") > "$OUT/serve.log" 2>&1
  echo "serve_bench exit $?"
fi

if [ -n "${PROFILE_STARTUP:-}" ]; then  # where the 0.6B cold start goes (cProfile of LLM())
  timeout 120 python3 bench.py --dummy qwen3-0.6b --profile-startup > "$OUT/startup-profile.txt" 2>&1
fi

if [ -n "${KERNEL_BENCHES:-}" ]; then
  PYTHONPATH=. timeout 200 python3 benchmarks/kernels/bench_paged_decode.py --json "$OUT/splits.json" 2>&1 | tee "$OUT/bench-paged-decode.log"
  PYTHONPATH=. timeout 300 python3 benchmarks/kernels/bench_paged_decode.py --kv-fp8 --json "$OUT/splits-fp8.json" 2>&1 | tee "$OUT/bench-paged-decode-fp8.log"
  PYTHONPATH=. timeout 200 python3 benchmarks/kernels/bench_decode_order.py 2>&1 | tee "$OUT/bench-decode-order.log"
  PYTHONPATH=. timeout 200 python3 benchmarks/kernels/bench_gemm.py 2>&1 | tee "$OUT/bench-gemm.log"
  PYTHONPATH=. timeout 200 python3 benchmarks/kernels/bench_fp8_gemm.py 2>&1 | tee "$OUT/bench-fp8-gemm.log"
  PYTHONPATH=. timeout 120 python3 benchmarks/kernels/bench_fused_kv_store.py 2>&1 | tee "$OUT/bench-fused-kv-store.log"
  PYTHONPATH=. timeout 120 python3 benchmarks/kernels/bench_fused_kv_store.py --kv-fp8 2>&1 \
    | tee -a "$OUT/bench-fused-kv-store.log"
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    PYTHONPATH=. timeout 120 python3 benchmarks/kernels/bench_all_reduce.py 2>&1 | tee "$OUT/bench-all-reduce.log"
    PYTHONPATH=. timeout 120 python3 benchmarks/kernels/bench_prefill_all_reduce.py 2>&1 | tee "$OUT/bench-prefill-all-reduce.log"
  fi
fi

tests_rc=skipped
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-900} python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests ${PYTEST_ARGS:-} 2>&1 \
    | tee "$OUT/pytest_gpu.log"
  tests_rc=${PIPESTATUS[0]}
fi

{
echo
echo "=== summary ==="
echo "gpu tests: $(tail -n 1 "$OUT/pytest_gpu.log" 2>/dev/null)  (exit $tests_rc)"
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
print(f"{'model':<20}{'out tok/s':>11}{'total tok/s':>13}{'of floor':>10}{'of step floor':>15}{'cold s':>8}"
      f"{'bs1 ms/tok':>12}")
optional = ("qwen3-0.6b-logprobs",)
for m in ("qwen3-0.6b", "qwen3-0.6b-logprobs", "qwen3-8b", "qwen3-8b-tp2", "qwen3-8b-tp2-b"):
    f = os.path.join(out, f"bench-{m}.json")
    if not os.path.exists(f):
        if m not in optional:
            print(f"{m:<20}  (no result)")
        continue
    r = json.load(open(f))
    print(f"{m:<20}{r['output_tok_s']:>11.0f}{r['total_tok_s']:>13.0f}{r['fraction_of_floor']:>10.1%}"
          f"{r.get('fraction_of_step_floor', float('nan')):>15.1%}"
          f"{r['cold_start_s']:>8.1f}{r.get('decode_ms_per_token_bs1', float('nan')):>12.2f}  {r.get('startup_s', '')}")
PY
if [ -f "$OUT/serve.json" ]; then
  python3 - "$OUT/serve.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1])); s = r["server"]
print(f"serve: {s['output_tok_s']:.0f} tok/s = {r.get('server_vs_offline', float('nan')):.1%} of offline; steady "
      f"{s['steady_state']['output_tok_s']}; TTFT p50/p99 {s['ttft_ms']['p50']:.0f}/{s['ttft_ms']['p99']:.0f} ms; ITL "
      f"mean/p50/p99 {s['itl_ms']['mean']:.2f}/{s['itl_ms']['p50']:.2f}/{s['itl_ms']['p99']:.2f} ms "
      f"(under 0.2 ms: {s['itl_under_0.2ms_share']:.1%})")
def steps(where, stats):
    for kind, g in stats.items():
        print(f"  {where} {kind} steps: {g['steps']}, {g['seconds']:.2f} s, gap p50/p99/max {g['gap_ms'].get('p50', 0):.2f}/"
              f"{g['gap_ms'].get('p99', 0):.2f}/{g['gap_ms'].get('max', 0):.1f} ms, wait p50/p99 "
              f"{g['wait_ms'].get('p50', 0):.2f}/{g['wait_ms'].get('p99', 0):.2f} ms, mean rows {g['mean_rows']:.1f}, "
              f"mean tokens {g['mean_tokens']:.0f}")
steps("server", s["engine_steps"])
c = r.get("closed_loop")
if c:
    print(f"closed loop (no HTTP): {c['output_tok_s']:.0f} tok/s; TTFT p50/p99 {c['ttft_ms']['p50']:.0f}/"
          f"{c['ttft_ms']['p99']:.0f} ms; ITL mean/p50/p99 {c['itl_ms']['mean']:.2f}/{c['itl_ms']['p50']:.2f}/"
          f"{c['itl_ms']['p99']:.2f} ms; triton compiles {c['triton_compiles']}; allocator {c['cuda_allocator']}")
    steps("closed", c["engine_steps"])
PY
fi
} | tee "$OUT/summary.txt"
