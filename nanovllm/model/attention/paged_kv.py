"""The paged KV cache in plain torch: store and gather (an FP8 cache's encoding: fp8_cache.py).

A layer's K (and V) cache is `[num_blocks, block_size, num_kv_heads, head_dim]`; token t of a
sequence lives in slot block_table[t // block_size] * block_size + t % block_size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from types import ModuleType

# The FP8 cache's encoding (fp8_cache.py), loaded for an FP8 cache only (filled by nanovllm.wiring).
FP8_CACHE: Callable[[], ModuleType] | None = None


def fp8_codec(k_cache: torch.Tensor, k_scale, v_scale):
    """fp8_cache.py for an FP8 cache, its scales checked (they come with it and only with it), or
    None for another cache without scales."""
    if k_cache.dtype != torch.float8_e4m3fn and k_scale is None and v_scale is None:
        return None
    codec = FP8_CACHE()
    return codec if codec.fp8_kv(k_cache, k_scale, v_scale) else None


def store_kvcache_torch(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Reference KV store: each token's K/V into its slot (-1: skip), quantized for an FP8 cache."""
    codec = fp8_codec(k_cache, k_scale, v_scale)
    if codec is not None:
        k, v = codec.quantize_kv(k, k_scale), codec.quantize_kv(v, v_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence: [length, num_kv_heads, head_dim]."""
    block_size = cache.size(1)
    num_blocks = -(-length // block_size)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:length]
