#!/usr/bin/env bash
# One call: the FP8-cache paged-decode kernel's launch configurations and split multipliers on
# .ab_base (a git archive of the commit before; run() with carry [".ab_base"]) and on this tree,
# bench_decode_fp8_config.py of this tree on both.
set -uo pipefail
for side in base new; do
  tree=$PWD; [ $side = base ] && { tree=$PWD/.ab_base; cp benchmarks/kernels/bench_decode_fp8_config.py $tree/benchmarks/kernels/; }
  echo "== $side"
  (cd $tree/benchmarks/kernels && PYTHONPATH=$tree timeout 200 python3 bench_decode_fp8_config.py --configs ${CONFIGS:-64/2/3,64/4/2,128/4/2,128/4/3,64/2/2,128/2/2,256/8/2,128/8/3} --split-factors ${FACTORS:-1,2}) 2>&1 | grep -v -i warn
done
