#!/usr/bin/env bash
# The batch-1 A/B of the 2026-12-05 changes in one device call (~7 min): this tree against
# .ab_base (git archive of fb1234b: before the SiLU epilogue) on Qwen3-0.6B and 8B bf16, and
# against .ab_mid (git archive of afd91c9: the epilogue, not the norm chain) on 0.6B and 8B FP8; then the GPU
# tests of the chain (test_dense_gemv's batch-1 decode against transformers, no compile in a run).
# Carry [".ab_base", ".ab_mid"]. Logs under $OUT/vs_base, $OUT/vs_mid; the tables last.
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${OUT:-/tmp/gpu_chain}
OUT=$DEST/vs_base AB_BASE=.ab_base SPECS="qwen3-0.6b qwen3-8b" bash scripts/gpu_batch1.sh > "$DEST/vs_base.txt" 2>&1
OUT=$DEST/vs_mid AB_BASE=.ab_mid SPECS="qwen3-0.6b qwen3-8b:fp8" \
  TESTS="tests/test_dense_gemv.py tests/test_no_compile_in_a_run.py" bash scripts/gpu_batch1.sh > "$DEST/vs_mid.txt" 2>&1
echo "=== against fb1234b (before the epilogue)"; cat "$DEST/vs_base.txt"
echo "=== against afd91c9 (before the norm chain)"; cat "$DEST/vs_mid.txt"
