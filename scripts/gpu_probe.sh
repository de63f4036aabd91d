#!/usr/bin/env bash
# One call: 0.6B's bench with prefill graphs up to 2,048 (the default) and 16,384 tokens (the bench's
# 16k-token prefill steps run eagerly and the host never waits on them: host-bound?), the batch-1
# decode step of .ab_base (a git archive of the commit before) against this tree under wide block
# tables (LENS, default max_model_len 40,960: 160 decode splits at one row), GPU tests in TESTS.
# KBENCH=1: the paged-decode kernel on FP8 caches against bf16 (bench_decode_fp8_config.py).
# PROBE=1: also benchmarks/probe_prefill_host.py (host vs device time, synchronizing calls).
#   TESTS=tests/test_kernels.py PROBE=1 bash scripts/gpu_probe.sh     (run() with carry [".ab_base"])
set -uo pipefail
D=$OUT; mkdir -p $D
[ -n "${PROBE:-}" ] && { PYTHONPATH=. timeout 150 python3 benchmarks/probe_prefill_host.py > $D/prefill-eager.log 2>&1 || echo "probe failed: $(tail -n 3 $D/prefill-eager.log)"; }
[ -n "${PROBE_GRAPHS:-}" ] && { PYTHONPATH=. timeout 200 python3 benchmarks/probe_prefill_host.py --prefill-graph-tokens 16384 > $D/prefill-graphs.log 2>&1 || echo "probe (graphs) failed: $(tail -n 3 $D/prefill-graphs.log)"; }
for g in 2048 16384; do PYTHONPATH=. timeout 100 python3 bench.py --dummy qwen3-0.6b --max-prefill-graph-tokens $g --json $D/bench-g$g.json > $D/bench-g$g.log 2>&1 || echo "bench $g failed: $(tail -n 3 $D/bench-g$g.log)"; done
for len in ${LENS:-40960}; do
  for side in base new; do
    tree=$PWD; [ $side = base ] && tree=$PWD/.ab_base
    cp benchmarks/bench_decode_step.py $tree/benchmarks/
    (cd $tree && PYTHONPATH=$tree timeout 120 python3 benchmarks/bench_decode_step.py --dummy qwen3-0.6b --sizes 1 --profile-bs 1 --max-model-len $len --json $D/$side-$len.json > $D/$side-$len.log 2>&1) || echo "$side $len failed: $(tail -n 3 $D/$side-$len.log)"
  done
done
[ -n "${KBENCH:-}" ] && { (cd benchmarks/kernels && PYTHONPATH=../.. timeout 120 python3 bench_decode_fp8_config.py) > $D/decode-fp8-config.log 2>&1 || echo "fp8 config failed: $(tail -n 3 $D/decode-fp8-config.log)"; }
[ -n "${TESTS:-}" ] && { PYTHONPATH=. timeout 200 python3 -m pytest -q -m gpu $TESTS > $D/tests.log 2>&1; tail -n 3 $D/tests.log; }
grep -E "wall ms|device kernel|synchronizing" $D/prefill-*.log
for g in 2048 16384; do python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], r['output_tok_s'], r.get('cold_start_s'), [(t['group'], t['seconds']) for t in r.get('timeline', [])[:2]])" $D/bench-g$g.json; done
grep -A12 "synchronizing calls" $D/prefill-eager.log | tail -n 12 | cut -c1-220
grep -B1 -A28 "Self CPU %" $D/prefill-eager.log | cut -c1-160 | head -32
grep -A19 "device time by kernel" $D/prefill-eager.log | cut -c1-200
for f in $D/base-*.json $D/new-*.json; do python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; print(sys.argv[1].split('/')[-1], r['ms_per_step'], r.get('profile',{}).get('kernel_ms'))" $f; done
[ -n "${KBENCH:-}" ] && cat $D/decode-fp8-config.log | grep -v Warn | tail -n 6
