#!/usr/bin/env bash
# Decode-step A/B in one device call (batch 1 unless SIZES): this tree against AB_BASE (a `git archive` of the commit
# before, carried), per-step time and kernel profile at one row (benchmarks/bench_decode_step.py,
# the new tree's copy run against each side's package), for Qwen3-0.6B bf16 and Qwen3-8B bf16 /
# FP8 / INT4 (dummy weights); then the GPU tests named in TESTS and bench.py --latency runs named
# in BENCH ("model[:quant] ...", AB_BENCH=1: both sides). Results under $OUT; a table last.
#   AB_BASE=.ab_base TESTS="tests/test_dense_gemv.py" BENCH="qwen3-0.6b" bash scripts/gpu_batch1.sh
set -uo pipefail
cd "$(dirname "$0")/.."
NEW=$PWD
BASE=$(cd "${AB_BASE:?AB_BASE must name the folder of the other side}" && pwd)
DEST=${OUT:-/tmp/gpu_batch1}
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1
cp benchmarks/bench_decode_step.py "$BASE/benchmarks/"
for spec in ${SPECS:-qwen3-0.6b qwen3-8b qwen3-8b:fp8 qwen3-8b:gptq}; do
  m=${spec%%:*}; extra=""; [ "$spec" != "$m" ] && extra="--quantization ${spec#*:}"
  for side in base new; do
    tree=$NEW; [ "$side" = base ] && tree=$BASE
    (cd "$tree" && PYTHONPATH="$tree" timeout 150 python3 benchmarks/bench_decode_step.py --dummy "$m" $extra \
      --sizes "${SIZES:-1}" --profile-bs "${PROFILE_BS:-1}" --json "$DEST/step-$side-${spec/:/-}.json" > "$DEST/step-$side-${spec/:/-}.log" 2>&1) \
      || echo "step $side $spec failed: $(tail -n 3 "$DEST/step-$side-${spec/:/-}.log")"
  done
done
[ -n "${TESTS:-}" ] && PYTHONPATH=. timeout 300 python3 -m pytest -q -m gpu $TESTS > "$DEST/tests.log" 2>&1
for spec in ${BENCH:-}; do  # AB_BENCH=1: the base side too (base-<spec>), base first
  m=${spec%%:*}; extra=""; [ "$spec" != "$m" ] && extra="--quantization ${spec#*:}"
  for side in ${AB_BENCH:+base} new; do
    tree=$NEW; name="bench-${spec/:/-}"; [ "$side" = base ] && { tree=$BASE; name="base-${spec/:/-}"; }
    (cd "$tree" && PYTHONPATH="$tree" timeout 200 python3 bench.py --dummy "$m" $extra --latency --json "$DEST/$name.json" \
      > "$DEST/$name.log" 2>&1) || echo "$name failed: $(tail -n 3 "$DEST/$name.log")"
  done
done
[ -f "$DEST/tests.log" ] && { echo "=== tests"; tail -n 5 "$DEST/tests.log"; }
python3 - "$DEST" <<'PY'
import glob, json, os, sys
d = sys.argv[1]
print(f"{'batch 1':<16}{'base ms':>9}{'new ms':>9}{'new/base':>9}{'base kern':>10}{'new kern':>10}{'kernels':>12}")
for f in sorted(glob.glob(f"{d}/step-new-*.json")):
    spec = f.split("step-new-")[1][:-5]
    try:
        sides = [json.load(open(f"{d}/step-{s}-{spec}.json"))["rows"] for s in ("base", "new")]
    except (OSError, KeyError):
        continue
    for b, n in zip(*sides):
        bp, np_ = b.get("profile", {}), n.get("profile", {})
        print(f"{spec + ' x' + str(n.get('batch', '')):<16}{b['ms_per_step']:>9}{n['ms_per_step']:>9}"
              f"{n['ms_per_step'] / b['ms_per_step']:>9.3f}{bp.get('kernel_ms', 0):>10}{np_.get('kernel_ms', 0):>10}"
              f"{str(bp.get('kernels_per_step')) + '->' + str(np_.get('kernels_per_step')):>12}")
for f in sorted(glob.glob(f"{d}/bench-*.json")) + sorted(glob.glob(f"{d}/base-*.json")):
    r = json.load(open(f))
    print(os.path.basename(f)[:-5], "tok/s", r["output_tok_s"], "bs1 ms", r.get("decode_ms_per_token_bs1"),
          "floor", r.get("fraction_of_floor"))
PY
