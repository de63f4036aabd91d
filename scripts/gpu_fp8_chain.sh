#!/usr/bin/env bash
# One call: online FP8's per-row decode chain (this tree) against .ab_mid (the per-tensor
# quantizer with its amax in slots) and .ab_base (torch's amax), each carried: the chain's tests, then
# bench.py on Qwen3-8B FP8 weights + cache on each tree and bf16 on this one (PAIRS side:spec), then GPU_TESTS (-m gpu).
set -uo pipefail
D=$OUT; mkdir -p $D
PYTHONPATH=. timeout 120 python3 -m pytest -q tests/test_fp8_chain.py tests/test_fused_qk_norm_rope.py \
  tests/test_fp8_gemm.py > $D/tests.log 2>&1; tail -n 2 $D/tests.log
for pair in ${PAIRS:-new:fp8 base:fp8 new:bf16 mid:fp8}; do
  side=${pair%%:*}; spec=${pair#*:}
  tree=$PWD; [ $side = mid ] && tree=$PWD/.ab_mid; [ $side = base ] && tree=$PWD/.ab_base
  args="--quantization fp8 --kv-cache-dtype fp8"; [ $spec = bf16 ] && args=""
  (cd $tree && PYTHONPATH=$tree timeout 150 python3 bench.py --dummy ${MODEL:-qwen3-8b} $args --json $D/$side-$spec.json \
    > $D/$side-$spec.log 2>&1) || echo "$side $spec failed: $(tail -n 3 $D/$side-$spec.log)"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], r['output_tok_s'], r['seconds'], r.get('fraction_of_step_floor'), [(t['group'], t['ms_per_step']) for t in r.get('timeline', [])][1:5])" $D/$side-$spec.json "$side $spec"
done
[ -n "${GPU_TESTS:-}" ] && { PYTHONPATH=. timeout 200 python3 -m pytest -q -m gpu $GPU_TESTS > $D/gpu_tests.log 2>&1; tail -n 2 $D/gpu_tests.log; }
