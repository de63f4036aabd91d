#!/usr/bin/env bash
# Repeat one bench.py A/B several times, alternating sides, to tell a change from run-to-run spread:
#   AB_BASE=.ab_base MODEL=qwen3-0.6b REPEAT=2 bash scripts/gpu_ab_repeat.sh
# Prints each run's output tok/s and decode time per step, then the median of each side.
set -uo pipefail
cd "$(dirname "$0")/.."
NEW=$PWD
BASE=$(cd "${AB_BASE:?AB_BASE must name the folder of the other side}" && pwd)
DEST=${OUT:-/tmp/gpu_ab_repeat}
mkdir -p "$DEST"
for r in $(seq 1 "${REPEAT:-2}"); do
  for side in base new; do
    tree=$NEW; [ "$side" = base ] && tree=$BASE
    (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" timeout 200 python3 bench.py --dummy "${MODEL:-qwen3-0.6b}" \
      --json "$DEST/rep-$side-$r.json" > /tmp/rep-$side-$r.log 2>&1) || echo "$side $r failed: $(tail -n 3 /tmp/rep-$side-$r.log)"
  done
done
python3 - "$DEST" <<'PY'
import glob, json, os, statistics, sys
d = sys.argv[1]
rows = {"base": [], "new": []}
for f in sorted(glob.glob(os.path.join(d, "rep-*.json"))):
    side = os.path.basename(f).split("-")[1]
    r = json.load(open(f))
    dec = sum(g["seconds"] for g in r.get("timeline", []) if g.get("group", "").startswith("decode"))
    rows[side].append(r["output_tok_s"])
    print(f"{os.path.basename(f):<18}{r['output_tok_s']:>10.0f} tok/s  decode {dec:.3f} s")
for side, v in rows.items():
    if v:
        print(f"{side}: median {statistics.median(v):.0f} tok/s over {len(v)} runs")
PY
