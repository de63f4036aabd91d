"""Every Triton kernel compiled for Hopper (sm90) down to a cubin, on any machine, with the
dtypes the H200 runs (bf16 activations; bf16 or FP8 caches, weights and activations).

CI runs the kernels through Triton's interpreter (fp32 / fp16), which never type-checks them
as the CUDA front end does: the fused K/V store's FP8 branch reassigned a bf16 value with an
fp32 one under a runtime `if`, passed every CPU test and failed to compile on the H200. Here
tests/hopper_compile.py calls each kernel's wrapper with CPU tensors, catches the launches and
compiles them with triton.compile for sm90 (Triton ships ptxas; no GPU needed). It runs in a
subprocess: conftest switches the interpreter on for this one, and the interpreter's
@triton.jit cannot be compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import hopper_compile  # noqa: E402  (its scenarios; nothing here runs a kernel)
from triton_caches import json_without_interpreter  # noqa: E402

_RESULTS: dict[str, list[dict]] = {}


def _results() -> dict[str, list[dict]]:
    """Every scenario's compiled launches, from one subprocess (cached for the module)."""
    if not _RESULTS:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # (the default; set, so that Triton does not warn)
        proc = subprocess.run([sys.executable, os.path.join(HERE, "hopper_compile.py")], env=env,
                              capture_output=True, text=True, timeout=900)
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                _RESULTS.setdefault(r["scenario"], []).append(r)
        assert _RESULTS, f"hopper_compile.py printed nothing (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    return _RESULTS


@pytest.mark.parametrize("scenario", list(hopper_compile.SCENARIOS))
def test_kernels_compile_for_hopper(scenario):
    results = _results().get(scenario)
    assert results, f"{scenario}: no result (the subprocess died before it?)"
    failed = [(r.get("kernel"), r["error"]) for r in results if not r["ok"]]
    assert not failed, failed


def test_the_compile_check_fails_on_a_type_change_under_a_runtime_if(tmp_path):
    """The check itself: a kernel that reassigns a bf16 value with an fp32 one inside a runtime
    `if` (the fused store's old bug) is refused; the same kernel without the reassignment
    compiles."""
    (tmp_path / "bad_kernels.py").write_text('''
import triton
import triton.language as tl

@triton.jit
def reassigning(x_ptr, out_ptr, flag, FP32: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, 16))
    if flag > 0:
        if FP32:
            x = x.to(tl.float32) * 2.0
        tl.store(out_ptr + tl.arange(0, 16), x.to(out_ptr.dtype.element_ty))

@triton.jit
def not_reassigning(x_ptr, out_ptr, flag, FP32: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, 16))
    if flag > 0:
        if FP32:
            tl.store(out_ptr + tl.arange(0, 16), (x.to(tl.float32) * 2.0).to(out_ptr.dtype.element_ty))
''')
    script = f'''
import sys, json, torch
sys.path[:0] = [{HERE!r}, {str(tmp_path)!r}]
import bad_kernels, hopper_compile
for kernel in (bad_kernels.reassigning, bad_kernels.not_reassigning):
    args = dict(x_ptr=torch.zeros(16, dtype=torch.bfloat16), out_ptr=torch.zeros(16, dtype=torch.bfloat16), flag=1,
                FP32=True)
    try:
        hopper_compile.compile_launch(kernel, args, {{}})
        print(json.dumps(True))
    except Exception:
        print(json.dumps(False))
'''
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert [json.loads(x) for x in proc.stdout.split()] == [False, True], proc.stderr[-3000:]


_MMA_LOOP = r"""
import json, os, re, subprocess, sys, tempfile
import triton
sys.path.insert(0, sys.argv[1])
import torch
import hopper_compile
from nanovllm.kernels.w4a16 import Mma, w4a16_matmul

rows = []
for m, cfg in ((16, Mma(16, 64, 128, 4)), (64, Mma(64, 128, 128, 4, 8)), (300, Mma(128, 64, 64, 1, 4, 4)),
               (300, Mma(128, 128, 64, 1, 8, 4))):
    k, n = 4096, 6144
    launch = lambda: w4a16_matmul(torch.randn(m, k).to(torch.bfloat16), torch.zeros(k // 8, n, dtype=torch.int32),
                                  torch.ones(k // 128, n).to(torch.bfloat16), torch.ones(k // 128, n).to(torch.bfloat16),
                                  128, config=cfg)
    kernel, named, options = hopper_compile.capture_launches(launch)[0]  # (split K: then sum_splits_kernel)
    compiled = hopper_compile.compile_launch(kernel, named, options)
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:  # SASS: PRMTs repack register pairs
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"),
                               "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout
    label = re.search(r"^(\$L__BB\d+_\d+):\s*// =>This Inner Loop Header", ptx, re.M)  # the K loop's block
    loop = ptx[label.start():]
    loop = loop[:re.search(r"bra(\.uni)?\s+" + re.escape(label.group(1)) + ";", loop).end()]  # to its back edge
    code = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    back = [(a, int(t, 16)) for a, op in code for t in re.findall(r"BRA\s+0x([0-9a-f]+)", op) if int(t, 16) < a]
    lo, hi = min(((t, a) for a, t in back if any(t <= b <= a and "HGMMA" in o for b, o in code)),
                 key=lambda r: r[1] - r[0])  # the SASS K loop: the smallest back edge around the wgmmas
    rows.append({"config": list(cfg), "wgmma": loop.count("wgmma.mma_async"), "st_shared": loop.count("st.shared"),
                 "bar_sync": loop.count("bar.sync"), "prmt": sum("PRMT" in o for b, o in code if lo <= b <= hi),
                 "wgmma_waits": [o.split(",")[-1].strip() for b, o in code
                                 if lo <= b <= hi and "WARPGROUP.DEPBAR" in o]})
print(json.dumps(rows))
"""


def test_the_int4_tensor_core_loop_keeps_the_unpacked_tile_in_registers():
    """kernels/w4a16_mma.py compiled for sm90 (PTX, SASS): in the fragment order the unpacked weight
    tile is already wgmma's register operand, so the K loop stores nothing to shared memory and
    waits at few barriers (the words and x arrive by cp.async). Words in plain order made sm90
    store each tile to shared memory and read it back (8 st.shared.v4, ~11 bar.sync a step), and
    any change that brings that back (a tile construction whose layout wgmma cannot take) fails
    here before it costs the GPU 1.0-2.9x (BENCHMARKS.md). And no PRMT in the SASS loop: each unpacked
    pair is a register pair wgmma takes (nibbles paired j, j + 4 as rows 2t, 2t + 1; with the
    pairs on rows 2t and 2t + 16, sm90 repacked them, 16 PRMTs a K-step of 128-row tiles). One wait
    a step, for every wgmma of tiles up to 64 rows and of 8 warps: none stays in flight while the
    next step's unpacking rewrites its register operand (Triton 3.6 left three, and 8-warp 128 x
    128 tiles went wrong)."""
    for row in json_without_interpreter(_MMA_LOOP):
        assert row["wgmma"] > 0 and row["st_shared"] == 0 and row["bar_sync"] <= 3 and row["prmt"] == 0, row
        block_m, warps = row["config"][0], row["config"][4]
        if block_m <= 64 or warps > 4:  # (4-warp 128-row tiles keep the overlap: w4a16_mma._settled)
            assert row["wgmma_waits"] == ["0x0"], row
