"""The reference attention backend (CPU, and the check of the others): SDPA per sequence over
K/V gathered through the block table."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanovllm.model.attention.metadata import AttentionMetadata
from nanovllm.model.attention.paged_kv import fp8_codec, gather_kv, store_kvcache_torch


class TorchBackend:
    """Loops over sequences on the host."""

    name = "torch"
    fp8_cache = True

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        store_kvcache_torch(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                k_scale=None, v_scale=None) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        codec = fp8_codec(k_cache, k_scale, v_scale)  # (None: not an FP8 cache)
        # Without cached tokens a prefill attends only to this step's K/V: no cache read needed.
        fresh = meta.is_prefill and not meta.has_prefix
        if fresh and codec is not None:
            k, v = codec.round_trip_kv(k, k_scale, q.dtype), codec.round_trip_kv(v, v_scale, q.dtype)
        for i, (n_q, n_k) in enumerate(zip(meta.query_lens, meta.kv_lens)):
            if n_q == 0:
                continue
            qi = q[start:start + n_q].transpose(0, 1)                    # [H, n_q, D]
            if fresh:
                ki = k[start:start + n_q].transpose(0, 1)
                vi = v[start:start + n_q].transpose(0, 1)
            else:
                ki, vi = gather_kv(k_cache, meta.block_tables[i], n_k), gather_kv(v_cache, meta.block_tables[i], n_k)
                if codec is not None:
                    ki, vi = codec.dequantize_kv(ki, k_scale, q.dtype), codec.dequantize_kv(vi, v_scale, q.dtype)
                ki, vi = ki.transpose(0, 1), vi.transpose(0, 1)
            group = qi.size(0) // ki.size(0)
            ki = ki.repeat_interleave(group, dim=0)
            vi = vi.repeat_interleave(group, dim=0)
            # Bottom-right causal mask: query j sits at absolute position n_k - n_q + j.
            qpos = torch.arange(n_k - n_q, n_k, device=q.device).unsqueeze(1)
            mask = torch.arange(n_k, device=q.device).unsqueeze(0) <= qpos
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
            out[start:start + n_q] = oi.transpose(0, 1)
            start += n_q
        return out
