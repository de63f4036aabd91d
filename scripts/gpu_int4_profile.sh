#!/usr/bin/env bash
# One device call: Nsight Compute on the INT4 tensor-core GEMM at 256 rows (gate_up: choose's
# launch and 128 columns on 8 warps) and on bf16 F.linear's cuBLAS kernel for the same product,
# then bench.py --latency on Qwen3-8B GPTQ and bf16, then the INT4 GPU tests while time is left
# (BUDGET seconds, default 560). Logs under $OUT; a table last.
set -uo pipefail
cd "$(dirname "$0")/.."
D=${OUT:-/tmp/gpu_int4_profile}; mkdir -p "$D"; export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
BUDGET=${BUDGET:-560}
left() { [ $((BUDGET - SECONDS)) -gt "$1" ]; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$D/gpu.txt"
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
  --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats --section InstructionStats"
prof() {  # name kernel-regex args...
  local name=$1 kre=$2; shift 2
  left 120 || return
  timeout 100 ncu --clock-control none -k "regex:$kre" --launch-skip 4 --launch-count 1 $SECTIONS \
    python3 benchmarks/kernels/profile_w4a16.py "$@" > "$D/ncu-$name.log" 2>&1 || echo "ncu $name failed: $(tail -n 3 "$D/ncu-$name.log")"
}
prof mma-choose mma_kernel --gemm gate_up --m 256
prof mma-128x8 mma_kernel --gemm gate_up --m 256 --cfg 128,128,64,1,8,4
prof cublas 'gemm|sm90|cutlass|nvjet' --gemm gate_up --m 256 --bf16
bench() {  # name args...
  local name=$1; shift
  left 120 || { echo "$name skipped (time)"; return; }
  timeout 115 python3 bench.py --dummy qwen3-8b --latency --json "$D/$name.json" "$@" > "$D/$name.log" 2>&1 \
    || echo "$name failed: $(tail -n 3 "$D/$name.log")"
}
bench gptq --quantization gptq
bench bf16
left 40 && timeout $((BUDGET - SECONDS - 10)) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py \
  tests/test_int4.py tests/test_int4_moe.py -k "int4 or w4a16" > "$D/tests.log" 2>&1
echo "=== tests"; tail -n 3 "$D/tests.log" 2>/dev/null
for f in "$D"/ncu-*.log; do
  echo "=== $(basename "$f")"
  grep -E "^\s+(Duration|Compute \(SM\) Throughput|Memory Throughput|L1/TEX Cache Throughput|L2 Cache Throughput|DRAM Throughput|Executed Ipc Active|Issue Slots Busy|No Eligible|Registers Per Thread|Achieved Occupancy|Warp Cycles Per Issued|Block Size|Grid Size|Dynamic Shared|Theoretical Occupancy|Mem Busy|Max Bandwidth|L2 Hit Rate|Executed Instructions )" "$f" | head -30
done
python3 - "$D" <<'PY'
import json, os, sys
d = sys.argv[1]
for n in ("bf16", "gptq"):
    p = f"{d}/{n}.json"
    r = json.load(open(p)) if os.path.exists(p) else None
    print(f"{n:<6}" + (f"{r['output_tok_s']:>9.0f} tok/s  bs1 {r.get('decode_ms_per_token_bs1') or 0:.3f} ms  cold {r.get('cold_start_s') or 0:.1f} s" if r else " (none)"))
PY
