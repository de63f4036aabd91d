"""The paged KV cache of one rank: how many blocks fit, and the tensor that holds them: one tensor
[2 (K, V), layers, blocks, block_size, kv_heads, head_dim], each attention layer viewing its K and
V caches (flash-attn's paged layout per layer)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # automatic KV-cache size on CPU


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one rank's KV cache, per block."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, attn_layers, device: torch.device) -> torch.Tensor:
    """The cache tensor for `num_blocks` blocks; binds each layer's k_cache / v_cache views."""
    if num_blocks < 1:
        raise RuntimeError("no GPU memory left for the KV cache: lower max_num_batched_tokens or "
                           "raise gpu_memory_utilization")
    cache = torch.empty(2, spec.num_layers, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim,
                        dtype=spec.dtype, device=device)
    for i, layer in enumerate(attn_layers):
        layer.k_cache = cache[0, i]
        layer.v_cache = cache[1, i]
    logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s, %d bytes per token)", num_blocks,
                spec.block_size, num_blocks * spec.block_size, num_blocks * spec.bytes_per_block / 2**30,
                str(spec.dtype).removeprefix("torch."), spec.bytes_per_block // spec.block_size)
    return cache


def blocks_that_fit(config, spec: KVCacheSpec, max_blocks_per_seq: int, gpu_blocks=None) -> int:
    """KV blocks for this rank: `config.num_kvcache_blocks` when given, else as many as a budget
    holds of the model's K/V and a draft model's (speculative decoding keeps both in the same
    blocks): a fixed one on CPU, `gpu_blocks(bytes per block)` on a GPU (core/cuda_runtime.py)."""
    if config.num_kvcache_blocks > 0:
        return config.num_kvcache_blocks
    draft = config.speculation
    per_block = spec.bytes_per_block + (draft.kv_bytes_per_block(spec.block_size, config.dtype) if draft else 0)
    if gpu_blocks is not None:
        return gpu_blocks(per_block)
    return max(CPU_KV_CACHE_BYTES // per_block, max_blocks_per_seq)
