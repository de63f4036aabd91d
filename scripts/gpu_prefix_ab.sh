#!/usr/bin/env bash
# Prefills with cached tokens on the paged prefill kernel, in one device call: the GPU tests of
# what it touches (and the chain / GEMV tests, which run on CUDA when it is there), the kernel
# against gather + FlashAttention-2, then the engine A/B of prefix-hit prefills
# (bench_prefix_prefill.py) against AB_BASE (a `git archive` of the commit before, carried).
#   AB_BASE=.ab_base bash scripts/gpu_prefix_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
BASE=$(cd "${AB_BASE:?AB_BASE must name the folder of the other side}" && pwd)
DEST=${OUT:-/tmp/gpu_prefix_ab}
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=. timeout 240 python3 -m pytest -q tests/test_norm_chain.py tests/test_dense_gemv.py tests/test_paged_prefill.py \
  > "$DEST/tests_kernels.log" 2>&1
PYTHONPATH=. timeout 150 python3 -m pytest -q -m gpu tests/test_attention.py tests/test_no_compile_in_a_run.py \
  > "$DEST/tests_gpu.log" 2>&1
PYTHONPATH=. timeout 150 python3 -m pytest -q -m gpu tests/test_gpu.py -k "backends_agree or bf16_matches or cuda_graph_decode" \
  > "$DEST/tests_gpu_engine.log" 2>&1
PYTHONPATH=.:benchmarks/kernels OUT="$DEST" timeout 120 python3 benchmarks/kernels/bench_paged_prefill.py \
  > "$DEST/paged_prefill.log" 2>&1
cp benchmarks/bench_prefix_prefill.py "$BASE/benchmarks/"
for m in ${MODELS:-qwen3-0.6b qwen3-8b}; do
  for side in base new; do
    tree=$PWD; [ "$side" = base ] && tree=$BASE
    (cd "$tree" && PYTHONPATH="$tree" timeout 200 python3 benchmarks/bench_prefix_prefill.py --dummy "$m" \
      --json "$DEST/prefix-$side-$m.json" > "$DEST/prefix-$side-$m.log" 2>&1) \
      || echo "prefix $side $m failed: $(tail -n 3 "$DEST/prefix-$side-$m.log")"
  done
done
for f in tests_kernels tests_gpu tests_gpu_engine; do echo "=== $f"; tail -n 4 "$DEST/$f.log"; done
echo "=== paged prefill kernel"; tail -n 13 "$DEST/paged_prefill.log"
python3 - "$DEST" <<'PY'
import glob, json, sys
d = sys.argv[1]
print(f"{'prefix prefill':<30}{'base ms':>9}{'new ms':>9}{'new/base':>9}")
for f in sorted(glob.glob(f"{d}/prefix-new-*.json")):
    try:
        new, base = json.load(open(f))["rows"], json.load(open(f.replace("prefix-new-", "prefix-base-")))["rows"]
    except (OSError, KeyError):
        continue
    m = f.split("prefix-new-")[1][:-5]
    for b, n in zip(base, new):
        print(f"{m + ' ' + str(n['seqs']) + 'x(' + str(n['cached']) + '+' + str(n['new']) + ')':<30}"
              f"{b['ms']:>9}{n['ms']:>9}{n['ms'] / b['ms']:>9.3f}")
PY
