"""The attention layer: stores this step's K/V into its paged cache, then attends through the
engine's backend (selection.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

import nanovllm.model.attention.paged_kv as paged_kv
from nanovllm.model.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from nanovllm.model.attention.fp8_cache import KVScaleCalibrator


class Attention(nn.Module):
    """q: [tokens, num_heads, head_dim]; k, v: [tokens, num_kv_heads, head_dim]. The ModelRunner
    assigns `k_cache` / `v_cache`; an FP8 cache's `k_scale` / `v_scale` (fp32 [1]) are set in place
    (kernels and CUDA graphs hold their addresses), e.g. by `calibrate_next_prefill` (fp8_cache.py)."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])
        self.backend = None
        # Not in the state dict: the loader decides where checkpoint scales come from.
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.calibrate_next_prefill: KVScaleCalibrator | None = None
        # Called instead of attending (this layer, then forward's arguments) while piecewise prefill
        # graphs are captured (features/prefill_graphs.py).
        self.graph_break = None

    def forward(self, q, k, v, meta: AttentionMetadata, kv_stored: bool = False) -> torch.Tensor:
        """Attention output [tokens, num_heads, head_dim]; kv_stored: the caller already wrote
        k and v into the cache (model/fused_qk_norm_rope.py)."""
        if self.graph_break is not None:
            return self.graph_break(self, q, k, v, meta, kv_stored)
        if self.calibrate_next_prefill is not None and meta.is_prefill and k.numel():
            kv_stored = paged_kv.FP8_CACHE().calibrate(self, k, v)
        scales = (self.k_scale, self.v_scale) if self.k_cache.dtype == torch.float8_e4m3fn else (None, None)
        if self.k_cache.numel() and not kv_stored:
            self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, *scales)
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, *scales)
