#!/usr/bin/env bash
# Where SiLU * up and the norms fold at batch 1, decided in one device call (~7 min): this tree
# (SiLU in down_proj's prologue and the norm chain on small weights, gate_up's epilogue and no
# chain above 16 MB) against .ab_base (git archive of fb1234b: the prologue on small weights, a
# separate kernel above) on Qwen3-0.6B, 8B bf16 and 8B FP8, and against .ab_mid (git archive of
# afd91c9: gate_up's epilogue everywhere, no chain) on 0.6B; then the GPU tests of the batch-1
# paths and the dense GEMV kernel bench. Carry [".ab_base", ".ab_mid"]. Tables last.
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${OUT:-/tmp/gpu_silu_site}
W=/tmp/silu_site; mkdir -p "$W" "$DEST"
OUT=$W/vs_base AB_BASE=.ab_base SPECS="qwen3-0.6b qwen3-8b qwen3-8b:fp8" bash scripts/gpu_batch1.sh > "$DEST/vs_base.txt" 2>&1
OUT=$W/vs_mid AB_BASE=.ab_mid SPECS="qwen3-0.6b" TESTS="tests/test_dense_gemv.py tests/test_norm_chain.py \
  tests/test_no_compile_in_a_run.py tests/test_int4.py tests/test_fused_ops.py tests/test_paged_prefill.py \
  tests/test_attention.py" bash scripts/gpu_batch1.sh > "$DEST/vs_mid.txt" 2>&1
cp "$W/vs_mid/tests.log" "$DEST/" 2>/dev/null
for f in "$W"/vs_*/step-*-qwen3-0.6b.log; do  # the 0.6B kernel tables
  s=${f#$W/}; cp "$f" "$DEST/${s//\//_}"; done
(export PYTHONPATH=.:benchmarks/kernels OUT=$W; timeout 150 python3 benchmarks/kernels/bench_dense_gemv.py > "$DEST/dense_gemv.log" 2>&1)
echo "=== dense GEMV kernels"; tail -n 14 "$DEST/dense_gemv.log" | cut -c1-330
echo "=== against fb1234b (SiLU prologue on small weights, separate kernel above)"; cat "$DEST/vs_base.txt"
echo "=== against afd91c9 (gate_up's epilogue everywhere)"; cat "$DEST/vs_mid.txt"
