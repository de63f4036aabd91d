#!/usr/bin/env bash
# One call: online FP8's per-row decode chain (this tree) against .ab_base (main before it) and,
# if carried, .ab_mid (the per-tensor quantizer with its amax in slots, without the chain). Make
# them here first:  rm -rf .ab_base && mkdir .ab_base && git archive main | tar -x -C .ab_base
# (and likewise .ab_mid from the commit before the chain); run() with carry [".ab_base", ".ab_mid"].
# Order: the chain's and kernels' tests (CUDA: its graph-replay test too), bench.py on Qwen3-8B
# FP8 weights + cache per side and bf16 on this tree (PAIRS side:spec), ratios, batch-1 latency runs
# (LATENCY model:quant ...), 0.6B decode steps (STEPS sizes, PROFILE_BS), then GPU_TESTS (-m gpu).
# BENCH_ARGS go to every bench.py pair run (e.g. --latency).
set -uo pipefail
D=$OUT; mkdir -p $D
# test_fp8_chain runs on CUDA whole (its DEVICE); the other files' unmarked tests pass CPU tensors to
# Triton, which only the interpreter takes (CI), so here only their -m gpu ones.
PYTHONPATH=. timeout 150 python3 -m pytest -q tests/test_fp8_chain.py > $D/tests.log 2>&1; tail -n 2 $D/tests.log
PYTHONPATH=. timeout 120 python3 -m pytest -q -m gpu tests/test_fused_qk_norm_rope.py tests/test_fp8_gemm.py \
  > $D/tests_gpu_kernels.log 2>&1; tail -n 2 $D/tests_gpu_kernels.log
for pair in ${PAIRS:-new:fp8 base:fp8 new:bf16 mid:fp8}; do
  side=${pair%%:*}; spec=${pair#*:}
  tree=$PWD; [ $side = mid ] && tree=$PWD/.ab_mid; [ $side = base ] && tree=$PWD/.ab_base
  [ -d "$tree" ] || { echo "$side: no $tree"; continue; }
  args="--quantization fp8 --kv-cache-dtype fp8"; [ $spec = bf16 ] && args=""
  (cd $tree && PYTHONPATH=$tree timeout 150 python3 bench.py --dummy ${MODEL:-qwen3-8b} $args --json $D/$side-$spec.json ${BENCH_ARGS:-} \
    > $D/$side-$spec.log 2>&1) || echo "$side $spec failed: $(tail -n 3 $D/$side-$spec.log)"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], r['output_tok_s'], r['seconds'], r.get('decode_ms_per_token_bs1'), r.get('fraction_of_step_floor'), [(t['group'], t['ms_per_step']) for t in r.get('timeline', [])][1:5])" $D/$side-$spec.json "$side $spec"
done
python3 - $D <<'PY'
import json, os, sys
tok = {f[:-5]: json.load(open(os.path.join(sys.argv[1], f)))["output_tok_s"] for f in os.listdir(sys.argv[1]) if f.endswith(".json") and "-" in f}
if "new-bf16" in tok:
    print("ratios to bf16:", {k: round(v / tok["new-bf16"], 3) for k, v in tok.items() if k != "new-bf16"})
PY
for spec in ${LATENCY-qwen3-8b:gptq}; do  # batch-1 ms/token on this tree (INT4's H200 figure after 12-06's norm fold)
  m=${spec%%:*}; q=""; [ "$spec" != "$m" ] && q="--quantization ${spec#*:}"
  PYTHONPATH=. timeout 150 python3 bench.py --dummy $m $q --latency --json $D/latency-${spec/:/-}.json > $D/latency-${spec/:/-}.log 2>&1
  tail -n 2 $D/latency-${spec/:/-}.log
done
[ -n "${STEPS:-}" ] && { PYTHONPATH=. timeout 150 python3 benchmarks/bench_decode_step.py --dummy qwen3-0.6b --sizes $STEPS \
  --profile-bs ${PROFILE_BS:-0} --json $D/decode_steps.json > $D/decode_steps.log 2>&1; tail -n 8 $D/decode_steps.log; }
GPU_TESTS=${GPU_TESTS-"tests/test_fp8.py tests/test_no_compile_in_a_run.py"}
[ -n "$GPU_TESTS" ] && { PYTHONPATH=. timeout 300 python3 -m pytest -q -m gpu $GPU_TESTS > $D/gpu_tests.log 2>&1; tail -n 3 $D/gpu_tests.log; }
