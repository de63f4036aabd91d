"""Triton kernels compiled for Hopper (sm90) on any machine, down to a cubin: the CUDA
front end type-checks what the interpreter (TRITON_INTERPRET=1, CI's way of running kernels)
does not, e.g. a bf16 value turned fp32 inside a runtime `if`, which the H200 refused for the
fused K/V store with an FP8 cache while CI passed. No GPU is needed: Triton ships ptxas. The
compiles run in a subprocess, where @triton.jit is not the interpreter's (conftest turns it on
for this process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run as a script: compile every case given as JSON on stdin, print one JSON line per case.
COMPILER = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import importlib

for case in json.load(sys.stdin):
    module, name = case["kernel"].rsplit(".", 1)
    kernel = getattr(importlib.import_module(module), name)
    sig = {**case["signature"], **{k: "constexpr" for k in case["constexprs"]}}
    try:
        if list(sig) != list(kernel.arg_names):
            raise ValueError(f"arguments {list(sig)} are not the kernel's {list(kernel.arg_names)}")
        src = ASTSource(kernel, sig, constexprs={(kernel.arg_names.index(k),): v for k, v in case["constexprs"].items()})
        out = triton.compile(src, target=GPUTarget("cuda", 90, 32))
        print(json.dumps({"ok": bool(out.asm["cubin"])}), flush=True)
    except Exception as e:
        print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"[:3000]}), flush=True)
'''


def compile_for_hopper(cases: list[dict]) -> list[dict]:
    """triton.compile for sm90 of each case: {"kernel": "module.name", "signature": {runtime
    argument: Triton type string ('*bf16', 'i32', ...)}, "constexprs": {name: value}}."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # (the default; set, so that Triton does not warn)
    proc = subprocess.run([sys.executable, "-c", COMPILER], input=json.dumps(cases), env=env, capture_output=True,
                          text=True, timeout=600)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(cases), proc.stderr[-3000:]
    return results


def test_qk_norm_rope_with_the_kv_store_compiles_for_hopper():
    """bf16 activations into a bf16 or an FP8 cache, with and without q/k norms (the FP8 ones
    failed on the H200 before the store stopped reassigning its inputs' type)."""
    signature = {"qkv_ptr": "*bf16", "qkv_stride": "i32", "q_w_ptr": "*bf16", "k_w_ptr": "*bf16",
                 "cos_sin_ptr": "*fp32", "cos_sin_stride": "i32", "pos_ptr": "*i64", "q_ptr": "*bf16",
                 "k_ptr": "*bf16", "eps": "fp32", "k_cache_ptr": None, "v_cache_ptr": None, "slot_ptr": "*i64",
                 "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    cases = []
    for cache in ("*bf16", "*fp8e4nv"):
        for norm in (True, False):
            constexprs = dict(NUM_HEADS=16, NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_HEADS=8, NUM_Q_BLOCKS=2,
                              NUM_K_BLOCKS=1, NORM=norm, STORE=True, FP8=cache == "*fp8e4nv")
            cases.append({"kernel": "nanovllm.kernels.fused_ops._qk_norm_rope_kernel",
                          "signature": {**signature, "k_cache_ptr": cache, "v_cache_ptr": cache},
                          "constexprs": constexprs})
    results = compile_for_hopper(cases)
    failed = [(c["signature"]["k_cache_ptr"], c["constexprs"]["NORM"], r["error"]) for c, r in zip(cases, results)
              if not r["ok"]]
    assert not failed, failed
