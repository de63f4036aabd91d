"""Rotary position embedding, NeoX style (rotate halves), with optional Llama 3 frequency scaling."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from nanovllm.model.rope_scaling import Llama3RopeScaling


def rope_inv_freq(head_dim: int, base: float, scaling: Llama3RopeScaling | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32: base^(-2i / head_dim), rescaled by `scaling`
    (Llama 3's, model/rope_scaling.py) when given."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    return inv_freq if scaling is None else scaling.rescale(inv_freq)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, 1, head_dim // 2]. Computed in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their positions: `forward(positions, q, k) -> (q, k)`; one table per model."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: Llama3RopeScaling | None = None):
        super().__init__()
        # Always fp32, whatever the model dtype: rounding angles to bf16 would shift positions.
        inv_freq = rope_inv_freq(head_dim, base, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # One [max_position, 1, head_dim] table of cos|sin: a single gather per step.
        self.register_buffer("cos_sin", torch.cat((freqs.cos(), freqs.sin()), dim=-1).unsqueeze(1),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
