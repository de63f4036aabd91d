#!/usr/bin/env bash
# Structured outputs on the H200 in one call: the GPU tests of tests/test_structured_outputs.py
# and benchmarks/structured_bench.py (bench workload, every request JSON-constrained vs none).
# xgrammar is not on the machine: its wheels and their needs (cp312: xgrammar, apache-tvm-ffi,
# pydantic, pydantic-core, annotated-types, typing-inspection) travel in .whl/ (git-ignored; named
# in the device call's carry), installed first when present. Results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_structured}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
timeout 200 python3 -m pytest -q -m gpu tests/test_structured_outputs.py 2>&1 | tail -5 > "$OUT/tests.log"
timeout 300 python3 benchmarks/structured_bench.py --repeat ${REPEAT:-2} --json "$OUT/structured.json" \
  > "$OUT/bench.log" 2>&1
echo "=== tests"; cat "$OUT/tests.log"
echo "=== bench"; grep -E "tok/s|ratio" "$OUT/bench.log" | tail -6
