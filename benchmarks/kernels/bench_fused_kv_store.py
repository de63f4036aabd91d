"""q/k-norm + RoPE with the KV-cache store fused in, against the two kernels, at decode sizes.

    PYTHONPATH=. python3 benchmarks/kernels/bench_fused_kv_store.py [--kv-fp8]

Qwen3-0.6B's attention shapes (16 q heads, 8 kv heads of 128, bf16; block 256). For each batch
size B, one CUDA graph replays 28 "layers" (28 qkv buffers and caches, as the decode graph walks
them, so that nothing stays in L2 between calls) of either qk_norm_rope then store_kvcache, or
the fused qk_norm_rope(..., k_cache=, v_cache=, slot_mapping=); prints microseconds per layer
and the saving over the 28 layers of one decode step. --kv-fp8: an FP8 cache.
"""

from __future__ import annotations

import sys

import torch

from timing import cuda_graph_us  # benchmarks/kernels/timing.py (this folder)

from nanovllm.kernels.qk_norm_rope import qk_norm_rope
from nanovllm.kernels.kv_store import store_kvcache
from nanovllm.model.layers.rotary_embedding import RotaryEmbedding

LAYERS, NH, NKV, HD, BLOCK = 28, 16, 8, 128, 256
BATCHES = (1, 8, 32, 64, 128, 256)


def main() -> None:
    torch.manual_seed(0)
    fp8 = "--kv-fp8" in sys.argv[1:]
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    rotary = RotaryEmbedding(HD, 4096, 1_000_000.0).cuda()
    w = torch.ones(HD, device="cuda", dtype=torch.bfloat16)
    scales = (torch.tensor([0.02], device="cuda"), torch.tensor([0.02], device="cuda")) if fp8 else (None, None)
    num_blocks = 64
    caches = [(torch.zeros(num_blocks, BLOCK, NKV, HD, device="cuda", dtype=cache_dtype),
               torch.zeros(num_blocks, BLOCK, NKV, HD, device="cuda", dtype=cache_dtype)) for _ in range(LAYERS)]
    print(f"{'B':>5}{'two kernels us':>16}{'fused us':>10}{'saved us/layer':>16}{'saved us/step (28)':>20}"
          f"   ({'fp8' if fp8 else 'bf16'} cache)")
    for b in BATCHES:
        qkvs = [torch.randn(b, (NH + 2 * NKV) * HD, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
        pos = torch.randint(0, 4096, (b,), device="cuda")
        slots = torch.randperm(num_blocks * BLOCK, device="cuda")[:b].to(torch.int32)

        def two():
            for qkv, (kc, vc) in zip(qkvs, caches):
                q, k, v = qk_norm_rope(qkv, w, w, rotary.cos_sin, pos, NH, NKV, HD, 1e-6)
                store_kvcache(k, v, kc, vc, slots, *scales)

        def fused():
            for qkv, (kc, vc) in zip(qkvs, caches):
                qk_norm_rope(qkv, w, w, rotary.cos_sin, pos, NH, NKV, HD, 1e-6, k_cache=kc, v_cache=vc,
                             slot_mapping=slots, k_scale=scales[0], v_scale=scales[1])

        t2 = cuda_graph_us(two, calls=4) / LAYERS
        t1 = cuda_graph_us(fused, calls=4) / LAYERS
        print(f"{b:>5}{t2:>16.2f}{t1:>10.2f}{t2 - t1:>16.2f}{(t2 - t1) * LAYERS:>20.1f}", flush=True)


if __name__ == "__main__":
    main()
