#!/usr/bin/env bash
# Three trees in one call: .ab_base, .ab_mid and this one (git archives of the commits compared),
# the batch-1 decode step of each spec (bench_decode_step.py, profiled); the GPU tests in TESTS.
#   SPECS="qwen3-0.6b qwen3-8b:gptq" TESTS=tests/test_dense_gemv.py bash scripts/gpu_ab3.sh
set -uo pipefail
D=$OUT; mkdir -p $D/r
for spec in ${SPECS:-qwen3-8b:gptq qwen3-0.6b qwen3-8b qwen3-8b:fp8}; do
  m=${spec%%:*}; extra=""; [ "$spec" != "$m" ] && extra="--quantization ${spec#*:}"
  for side in base mid new; do
    tree=$PWD; [ $side = base ] && tree=$PWD/.ab_base; [ $side = mid ] && tree=$PWD/.ab_mid
    cp benchmarks/bench_decode_step.py $tree/benchmarks/ 2>/dev/null
    (cd $tree && PYTHONPATH=$tree timeout 120 python3 benchmarks/bench_decode_step.py --dummy $m $extra --sizes 1 --profile-bs 1 --json $D/r/$side-${spec/:/-}.json > $D/r/$side-${spec/:/-}.log 2>&1) || echo "$side $spec failed: $(tail -n 3 $D/r/$side-${spec/:/-}.log)"
  done
done
python3 - $D/r <<'PY'
import json, sys, glob
d = sys.argv[1]
for spec in sorted({f.split('/')[-1].split('-', 1)[1][:-5] for f in glob.glob(d + '/*.json')}):
    row = []
    for side in ('base', 'mid', 'new'):
        try:
            r = json.load(open(f'{d}/{side}-{spec}.json'))['rows'][0]
            row.append(f"{side} {r['ms_per_step']} ({r.get('profile', {}).get('kernel_ms')})")
        except Exception as e:
            row.append(f'{side} -')
    print(f'{spec:<16}', ' | '.join(row))
PY
[ -n "${TESTS:-}" ] && { PYTHONPATH=. timeout 240 python3 -m pytest -q -m gpu $TESTS > $D/tests.log 2>&1; tail -n 3 $D/tests.log; }
(cd $D && tar czf r.tgz r && rm -rf r)
if [ -n "${KERNELS:-}" ]; then  # the INT4 GEMV alone: base, and this tree with its launch sweep
  (cd .ab_base && PYTHONPATH=. OUT= timeout 100 python3 benchmarks/kernels/bench_w4a16.py --m 1 > $D/kern-base.log 2>&1)
  PYTHONPATH=. OUT= timeout 200 python3 benchmarks/kernels/bench_w4a16.py --m 1 --sweep > $D/kern-new.log 2>&1
  for s in base new; do echo "== kernels $s"; grep -E "^(qkv|o |gate|down)" $D/kern-$s.log | cut -c1-600; done
fi
