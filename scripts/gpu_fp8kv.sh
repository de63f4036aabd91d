#!/usr/bin/env bash
# One call: the FP8-cache decode kernel of this tree against .ab_base (a git archive of the commit
# before; run() with carry [".ab_base"]): its GPU tests, the kernel bench at the bench workload's
# decode shapes (bench_decode_fp8_config.py, CONFIGS), then bench.py on Qwen3-0.6B: bf16, and
# kv_cache_dtype fp8 on each tree (the target: fp8 >= 1.4x bf16). PROBE=1: also
# benchmarks/probe_prefill_host.py (where a 16k-token prefill step's time goes).
set -uo pipefail
D=$OUT; mkdir -p $D
PYTHONPATH=. timeout 240 python3 -m pytest -q -m gpu tests/test_kernels.py ${TESTS:-} > $D/tests.log 2>&1; tail -n 2 $D/tests.log
(cd benchmarks/kernels && PYTHONPATH=../.. timeout 120 python3 bench_decode_fp8_config.py --configs ${CONFIGS:-64/4/2,64/2/3}) > $D/kbench.log 2>&1 || echo "kbench failed: $(tail -n 3 $D/kbench.log)"
run_bench() {  # name tree args...
  local name=$1 tree=$2; shift 2
  (cd $tree && PYTHONPATH=$tree timeout 120 python3 bench.py --dummy qwen3-0.6b --json $D/$name.json "$@") > $D/$name.log 2>&1 || echo "$name failed: $(tail -n 3 $D/$name.log)"
}
run_bench fp8-new $PWD --kv-cache-dtype fp8
run_bench fp8-base $PWD/.ab_base --kv-cache-dtype fp8
run_bench bf16-new $PWD
run_bench fp8-new2 $PWD --kv-cache-dtype fp8
run_bench fp8-base2 $PWD/.ab_base --kv-cache-dtype fp8
run_bench bf16-new2 $PWD
[ -n "${PROBE:-}" ] && { PYTHONPATH=. timeout 150 python3 benchmarks/probe_prefill_host.py > $D/prefill-eager.log 2>&1 || echo "probe failed: $(tail -n 3 $D/prefill-eager.log)"; }
grep -v -i warn $D/kbench.log | tail -n 5 | cut -c1-160
for n in fp8-new fp8-base bf16-new fp8-new2 fp8-base2 bf16-new2; do python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], r['output_tok_s'], r['seconds'], [(t['group'], t['ms_per_step']) for t in r.get('timeline', [])][1:4])" $D/$n.json $n 2>/dev/null; done
[ -n "${PROBE:-}" ] && { grep -E "wall ms|device kernel|synchronizing calls" $D/prefill-eager.log; grep -A12 "synchronizing calls" $D/prefill-eager.log | tail -n 12 | cut -c1-200; grep -A19 "device time by kernel" $D/prefill-eager.log | cut -c1-200; }
