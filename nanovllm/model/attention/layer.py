"""The attention layer: stores this step's K/V into its paged cache, then attends through the
engine's backend (selection.py)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from nanovllm.model.attention.metadata import AttentionMetadata


class KVScaleCalibrator(Protocol):
    """Writes an FP8 cache's K and V scales (fp32 [1] buffers, in place) from a prefill's own K/V
    (features/quantization/fp8_kv.py)."""

    def __call__(self, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None: ...


class Attention(nn.Module):
    """q: [tokens, num_heads, head_dim]; k, v: [tokens, num_kv_heads, head_dim]. `k_cache` /
    `v_cache` are assigned by the ModelRunner once the cache is allocated; an FP8 cache is
    encoded with the `k_scale` / `v_scale` buffers (fp32 [1], default 1.0; set them in place
    with `.copy_()`: the kernels and CUDA graphs hold their addresses). A
    `calibrate_next_prefill` calibrator, once set, writes the scales from the next prefill's
    own K/V and is cleared."""

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
        # While piecewise prefill graphs are captured (features/prefill_graphs.py): called instead
        # of attending, with forward's arguments and this layer first; it returns the output.
        self.graph_break = None

    def fused_store_args(self, meta: AttentionMetadata) -> dict:
        """Keyword arguments that make `qk_norm_rope` (kernels/qk_norm_rope.py) store this step's
        K/V into the layer's cache (then call forward with kv_stored=True), or {} when the layer
        must store them itself: no cache yet (the start-up forwards), or a prefill that first
        calibrates the FP8 scales from its K/V."""
        if not self.k_cache.numel() or (self.calibrate_next_prefill is not None and meta.is_prefill):
            return {}
        args = dict(k_cache=self.k_cache, v_cache=self.v_cache, slot_mapping=meta.slot_mapping)
        if self.k_cache.dtype == torch.float8_e4m3fn:
            args.update(k_scale=self.k_scale, v_scale=self.v_scale)
        return args

    def forward(self, q, k, v, meta: AttentionMetadata, kv_stored: bool = False) -> torch.Tensor:
        """Attention output [tokens, num_heads, head_dim]; kv_stored: the caller already wrote
        k and v into the cache (with fused_store_args)."""
        if self.graph_break is not None:
            return self.graph_break(self, q, k, v, meta, kv_stored)
        if self.calibrate_next_prefill is not None and meta.is_prefill and k.numel():
            with torch.no_grad():
                self.calibrate_next_prefill(k, v, self.k_scale, self.v_scale)
            self.calibrate_next_prefill = None
            # Whatever the caller stored went in with the scales of before (a piecewise prefill
            # graph's fused store): store again with the calibrated ones.
            kv_stored = False
        scales = (self.k_scale, self.v_scale) if self.k_cache.dtype == torch.float8_e4m3fn else (None, None)
        if self.k_cache.numel() and not kv_stored:
            self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, *scales)
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, *scales)
