#!/usr/bin/env bash
# The serving benchmark (Qwen3-0.6B, 64 streaming clients) A/B, alternating sides REPEAT times:
#   AB_BASE=.ab_base REPEAT=2 bash scripts/gpu_serve_ab.sh   (FastAPI, uvicorn, pydantic importable)
set -uo pipefail
cd "$(dirname "$0")/.."
NEW=$PWD
BASE=$(cd "${AB_BASE:?AB_BASE must name the folder of the other side}" && pwd)
DEST=${OUT:-/tmp/gpu_serve_ab}
mkdir -p "$DEST"
for r in $(seq 1 "${REPEAT:-2}"); do
  sides="new base"; [ $((r % 2)) = 0 ] && sides="base new"
  for side in $sides; do
    tree=$NEW; [ "$side" = base ] && tree=$BASE
    (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" timeout 120 python3 benchmarks/serve_bench.py --dummy qwen3-0.6b \
      --clients 64 --requests 256 --offline none --timeout 100 --startup-timeout 60 --out "$DEST/serve-$side-$r.json" \
      > /tmp/serve-$side-$r.log 2>&1) || echo "$side $r failed: $(tail -n 3 /tmp/serve-$side-$r.log)"
    [ -f "$DEST/serve-$side-$r.json" ] && python3 -c "import json,sys; s=json.load(open(sys.argv[1]))['server']; \
print(sys.argv[2], round(s['output_tok_s']), 'tok/s; ITL p50/p99', round(s['itl_ms']['p50'], 2), round(s['itl_ms']['p99'], 2), 'TTFT p50', round(s['ttft_ms']['p50'], 1))" \
      "$DEST/serve-$side-$r.json" "$side-$r"
  done
done
