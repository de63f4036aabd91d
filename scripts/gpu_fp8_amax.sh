#!/usr/bin/env bash
# One call: the per-tensor FP8 activation quantizer with its amax in slots (this tree) against
# .ab_base (torch's vector_norm amax; run() with carry [".ab_base"]): the FP8 GEMM GPU tests, the
# GEMM bench on both trees (its tensor+q column is the engine's online-FP8 linear), then bench.py
# on Qwen3-8B FP8 weights + cache on each tree, and bf16 (the target: FP8 >= 1.5x bf16).
set -uo pipefail
D=$OUT; mkdir -p $D
PYTHONPATH=. timeout 150 python3 -m pytest -q -m gpu tests/test_fp8_gemm.py ${TESTS:-} > $D/tests.log 2>&1; tail -n 2 $D/tests.log
for side in base new; do
  tree=$PWD; [ $side = base ] && tree=$PWD/.ab_base
  echo "== GEMMs, $side"
  (cd $tree/benchmarks/kernels && PYTHONPATH=$tree timeout 150 python3 bench_fp8_gemm.py --no-sweep --models 8b --m ${MS:-16,64,256,1024}) 2>&1 | grep -v -i warn | grep -E " 8b |gemm" | cut -c1-110
done
for spec in "fp8-new:$PWD:--quantization fp8 --kv-cache-dtype fp8" "fp8-base:$PWD/.ab_base:--quantization fp8 --kv-cache-dtype fp8" "bf16:$PWD:"; do
  IFS=: read n tree args <<< "$spec"
  (cd $tree && PYTHONPATH=$tree timeout 150 python3 bench.py --dummy qwen3-8b $args --json $D/8b-$n.json > $D/8b-$n.log 2>&1) || echo "$n failed: $(tail -n 3 $D/8b-$n.log)"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], r['output_tok_s'], r['seconds'], r.get('fraction_of_step_floor'), [(t['group'], t['ms_per_step']) for t in r.get('timeline', [])][1:5])" $D/8b-$n.json $n
done
