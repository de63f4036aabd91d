#!/usr/bin/env bash
# A/B of this tree against another checkout of nano-vllm in one device call, same machine, same
# workload, alternating which side runs first per model (host speed drifts between processes):
#   AB_BASE=.ab_base MODELS="qwen3-0.6b qwen3-8b qwen3-8b:fp8" SERVE=1 bash scripts/gpu_ab.sh
# AB_BASE: a folder holding the other side's nanovllm/, bench.py and benchmarks/ (e.g. `git archive
# <commit> nanovllm bench.py benchmarks | tar -x -C .ab_base`, carried with the call). MODELS: bench.py
# --dummy names, ":fp8" adds --quantization fp8. SERVE=1: benchmarks/serve_bench.py (64 clients, server
# only) on both sides; it needs FastAPI, uvicorn and pydantic importable (PYTHONPATH). BENCH_ARGS: more
# bench.py flags for both sides (e.g. "--top-p 0.9 --top-k 50 --min-p 0.05 --cold-filters"). Logs and JSON go
# to $OUT (default /tmp/gpu_ab); a table of new / base is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
NEW=$PWD
BASE=$(cd "${AB_BASE:?AB_BASE must name the folder of the other side}" && pwd)
DEST=${OUT:-/tmp/gpu_ab}
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1
i=0
for spec in ${MODELS:-qwen3-0.6b}; do
  m=${spec%%:*}; extra=""; [ "$spec" != "$m" ] && extra="--quantization ${spec#*:}"
  sides="base new"; [ $((i % 2)) = 1 ] && sides="new base"; i=$((i + 1))
  for side in $sides; do
    tree=$NEW; [ "$side" = base ] && tree=$BASE
    (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" timeout 300 python3 bench.py --dummy "$m" $extra ${BENCH_ARGS:-} \
      --json "$DEST/ab-$side-${spec/:/-}.json" > "$DEST/ab-$side-${spec/:/-}.log" 2>&1) \
      || echo "bench $side $spec failed: $(tail -n 3 "$DEST/ab-$side-${spec/:/-}.log")"
  done
done
if [ -n "${SERVE:-}" ]; then
  for side in base new; do
    tree=$NEW; [ "$side" = base ] && tree=$BASE
    (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" timeout 280 python3 benchmarks/serve_bench.py --dummy qwen3-0.6b \
      --clients 64 --requests 256 --offline none --timeout 150 --startup-timeout 90 --out "$DEST/ab-$side-serve.json" \
      > "$DEST/ab-$side-serve.log" 2>&1) || echo "serve $side failed: $(tail -n 5 "$DEST/ab-$side-serve.log")"
  done
fi
python3 - "$DEST" <<'PY'
import glob, json, os, sys
d = sys.argv[1]
print(f"{'run':<22}{'base tok/s':>12}{'new tok/s':>12}{'new/base':>10}")
for f in sorted(glob.glob(os.path.join(d, "ab-base-*.json"))):
    name = os.path.basename(f)[len("ab-base-"):-5]
    g = os.path.join(d, f"ab-new-{name}.json")
    if not os.path.exists(g):
        print(f"{name:<22}  (no new result)"); continue
    def tok_s(path):
        r = json.load(open(path))
        return r["server"]["output_tok_s"] if "server" in r else r["output_tok_s"]
    b, n = tok_s(f), tok_s(g)
    print(f"{name:<22}{b:>12.0f}{n:>12.0f}{n / b:>10.3f}")
PY
