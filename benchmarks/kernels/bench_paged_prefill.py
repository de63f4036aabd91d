"""Prefills with cached tokens: the paged prefill kernel (kernels/paged_prefill.py, reading the
cache in place) against gathering each context into contiguous K/V for aten's FlashAttention-2
(model/attention/gathered_prefill.py; FP8 caches dequantized on the way). The Triton backend
takes the kernel up to TritonBackend.PAGED_PREFILL_MAX_Q new tokens a sequence and the gather
above, where this bench found FlashAttention-2 faster.

    PYTHONPATH=.:benchmarks/kernels python3 benchmarks/kernels/bench_paged_prefill.py

Qwen3-8B's attention shape (32 query heads, 8 kv heads, head_dim 128), block 256, bf16 q. Per
scenario (sequences x (cached prefix + new tokens)) and cache dtype: milliseconds of each path
(the mean of 20 eager calls after a warm-up, synchronized), the kernel's speed-up, and the
outputs' relative difference. Writes $OUT/paged_prefill.json when $OUT is set.
"""

from __future__ import annotations

import json
import os
import time

import torch

from nanovllm.kernels.paged_prefill import paged_prefill_attention
from nanovllm.model.attention.fp8_cache import dequantize_kv
from nanovllm.model.attention.gathered_prefill import flash_varlen, gather_kv_varlen

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 256
# (sequences, cached tokens, new tokens): chat turns behind a shared system prompt, a few long
# documents' follow-up questions, a chunked long prompt's later chunks (the last two: as many new
# tokens as cached ones, where attention is compute-bound, FlashAttention-2's best case).
SCENARIOS = [(64, 1024, 32), (16, 4096, 256), (4, 8192, 512), (1, 6144, 2048), (1, 8192, 8192),
             (1, 16384, 16384)]


def gathered(q, kc, vc, bt, cu_q, cu_k, ctx_total, max_q, max_k, scale, k_scale, v_scale):
    """The gather (+ dequantize) + FlashAttention-2 path, one group."""
    k = dequantize_kv(gather_kv_varlen(kc, bt, cu_k, ctx_total), k_scale, q.dtype)
    v = dequantize_kv(gather_kv_varlen(vc, bt, cu_k, ctx_total), v_scale, q.dtype)
    return flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale)


def ms(fn, calls: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / calls


def scenario(seqs: int, cached: int, new: int, fp8: bool, gen) -> dict:
    ctx = cached + new
    width = -(-ctx // BLOCK)
    kc = torch.randn(seqs * width, BLOCK, KV_HEADS, DIM, device="cuda", generator=gen).to(torch.bfloat16)
    vc = torch.randn_like(kc)
    k_scale = v_scale = None
    if fp8:
        k_scale, v_scale = torch.full((1,), 0.02, device="cuda"), torch.full((1,), 0.02, device="cuda")
        kc, vc = (kc.float() / 0.02).clamp(-448, 448).to(torch.float8_e4m3fn), (vc.float() / 0.02).clamp(-448, 448).to(
            torch.float8_e4m3fn)
    bt = torch.randperm(seqs * width, device="cuda", generator=gen).to(torch.int32).view(seqs, width)
    q = torch.randn(seqs * new, HEADS, DIM, device="cuda", generator=gen).to(torch.bfloat16)
    cu_q = torch.arange(0, seqs * new + 1, new, device="cuda", dtype=torch.int32)
    cu_k = torch.arange(0, seqs * ctx + 1, ctx, device="cuda", dtype=torch.int32)
    lens = torch.full((seqs,), ctx, device="cuda", dtype=torch.int32)
    scale = DIM ** -0.5
    old = lambda: gathered(q, kc, vc, bt, cu_q, cu_k, seqs * ctx, new, ctx, scale, k_scale, v_scale)  # noqa: E731
    kernel = lambda: paged_prefill_attention(q, kc, vc, bt, cu_q, lens, new, scale, k_scale, v_scale)  # noqa: E731
    a, b = old().float(), kernel().float()
    res = {"seqs": seqs, "cached": cached, "new": new, "cache": "fp8" if fp8 else "bf16",
           "gather_flash_ms": round(ms(old), 3), "kernel_ms": round(ms(kernel), 3),
           "rel_diff": round(((a - b).norm() / a.norm()).item(), 5)}
    res["speedup"] = round(res["gather_flash_ms"] / res["kernel_ms"], 2)
    return res


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = [scenario(*s, fp8, gen) for s in SCENARIOS for fp8 in (False, True)]
    print(f"{'seqs x (cached + new)':<24}{'cache':>6}{'gather+FA2 ms':>15}{'kernel ms':>11}{'speed-up':>10}{'rel diff':>10}")
    for r in rows:
        print(f"{str(r['seqs']) + ' x (' + str(r['cached']) + ' + ' + str(r['new']) + ')':<24}{r['cache']:>6}"
              f"{r['gather_flash_ms']:>15}{r['kernel_ms']:>11}{r['speedup']:>10}{r['rel_diff']:>10}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "paged_prefill.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
