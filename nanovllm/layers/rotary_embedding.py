"""Rotary position embedding, NeoX style (rotate halves), as Qwen3 uses."""

from __future__ import annotations

import torch
from torch import nn


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, 1, head_dim // 2]. Computed in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their positions: `forward(positions, q, k) -> (q, k)`; one table per model."""

    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        # Always fp32, whatever the model dtype: rounding angles to bf16 would shift positions.
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # One [max_position, 1, head_dim] table of cos|sin: a single gather per step.
        self.register_buffer("cos_sin", torch.cat((freqs.cos(), freqs.sin()), dim=-1).unsqueeze(1),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
