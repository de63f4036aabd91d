#!/usr/bin/env bash
# What the 2026-12-05 session built without a GPU, checked on one in one device call (~6 min):
# the GPU tests of the code it touched, then the kernel benches that decide its open choices
# (SiLU from gate_up's GEMV epilogue; the norm between two GEMVs from sums of squares; INT4
# dequant in L2-sized chunks; the FP8 paged prefill against gather + FlashAttention-2). Logs and
# JSON under $OUT; a summary last. The engine A/B of the epilogue is scripts/gpu_batch1.sh
# (AB_BASE: a git archive of fb1234b).
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${OUT:-/tmp/gpu_pending}
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1 OUT="$DEST"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
PYTHONPATH=. timeout 300 python3 -m pytest -q -m gpu tests/test_dense_gemv.py tests/test_int4.py \
  tests/test_paged_prefill.py tests/test_attention.py tests/test_fused_ops.py \
  tests/test_no_compile_in_a_run.py > "$DEST/tests.log" 2>&1
export PYTHONPATH=.:benchmarks/kernels
timeout 90 python3 benchmarks/kernels/bench_paged_prefill.py > "$DEST/paged_prefill.log" 2>&1
timeout 120 python3 benchmarks/kernels/bench_w4a16_chunks.py > "$DEST/w4a16_chunks.log" 2>&1
timeout 60 python3 benchmarks/kernels/bench_w4a16.py --m 1 > "$DEST/w4a16_m1.log" 2>&1
timeout 150 python3 benchmarks/kernels/bench_dense_gemv.py > "$DEST/dense_gemv.log" 2>&1
for f in tests paged_prefill w4a16_chunks w4a16_m1 dense_gemv; do
  echo "=== $f"; tail -n 20 "$DEST/$f.log"
done
