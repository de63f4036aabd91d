"""The paged KV cache in plain torch: store, gather, and the FP8 cache's encoding.

A layer's K (and V) cache is `[num_blocks, block_size, num_kv_heads, head_dim]`; token t of a
sequence lives in slot block_table[t // block_size] * block_size + t % block_size.

FP8 cache (vLLM's semantics, `kv_cache_dtype="fp8"`): float8_e4m3fn values, stored =
clamp(k / k_scale, -448, 448) and read back as stored.float() * k_scale (V likewise), with one
fp32 K and V scale per layer. The Triton kernels (kernels/kv_store.py, paged_decode.py) do the
same arithmetic; this is their reference and the CPU path.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448


def fp8_kv(k_cache: torch.Tensor, k_scale, v_scale) -> bool:
    """True for an FP8 cache; checks that the scales come with it and only with it (the
    kernels' check, kernels/kv_store.py)."""
    if k_cache.dtype != FP8_DTYPE and k_scale is None and v_scale is None:
        return False
    from nanovllm.kernels.kv_store import check_kv_scales  # (Triton: imported for FP8 caches only)

    return check_kv_scales(k_cache, k_scale, v_scale)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x as an FP8 cache stores it: clamp(x.float() / scale, -448, 448) in e4m3 (round to
    nearest even). The clamp comes first: torch's cast turns values beyond 448 into NaN."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cached K or V as attention reads it: FP8 rows times `scale` in fp32, then rounded to
    `dtype` (q's); rows of any other dtype unchanged."""
    if x.dtype != FP8_DTYPE:
        return x
    return (x.float() * scale).to(dtype)


def round_trip_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """This step's K or V as an FP8 cache will give it back, for a prefill that attends to
    it without reading the cache."""
    return dequantize_kv(quantize_kv(x, scale), scale, dtype)


def store_kvcache_torch(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Reference KV store: scatter each token's K/V into its slot (slot -1 = skip), quantized
    as `quantize_kv` says when the cache is FP8."""
    if fp8_kv(k_cache, k_scale, v_scale):
        k, v = quantize_kv(k, k_scale), quantize_kv(v, v_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence: [length, num_kv_heads, head_dim]."""
    block_size = cache.size(1)
    num_blocks = -(-length // block_size)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:length]
