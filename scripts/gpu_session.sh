#!/usr/bin/env bash
# A device call for whichever GPU comes. On an H200: the standing benches of main (scripts/gpu_standing.sh
# without its tests and attention sweep, with Qwen3-8B GPTQ), read from AB_BASE (default .ab_base: a git
# archive of main, carried) when there is one, else from this tree. On another GPU: the INT4 A/B of this
# tree against AB_BASE (scripts/gpu_int4_fragment.sh; its env passes through, e.g. SWEEP=1 SWEEP_SPLITS=1).
# BUDGET (default 540) bounds either.
set -uo pipefail
cd "$(dirname "$0")/.."
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1); echo "$GPU"
BASE=${AB_BASE:-.ab_base}
if [[ "$GPU" == *H200* ]]; then
  TREE=$([ -d "$BASE" ] && echo "$BASE" || echo .)
  SKIP_TESTS=1 SKIP_ATTENTION=1 INT4=1 BUDGET=${BUDGET:-540} bash "$TREE/scripts/gpu_standing.sh"
else
  BUDGET=${BUDGET:-540} bash scripts/gpu_int4_fragment.sh
fi
