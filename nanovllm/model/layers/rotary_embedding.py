"""Rotary position embedding, NeoX style (rotate halves), with optional Llama 3 frequency scaling."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's `rope_scaling` (rope_type "llama3"): long wavelengths are slowed down by
    `factor`, short ones kept, and the band between them interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"llama3 rope_scaling: factor must be > 0, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError("llama3 rope_scaling: need 0 < low_freq_factor < high_freq_factor, got "
                             f"{self.low_freq_factor} and {self.high_freq_factor}")
        if not self.original_max_position_embeddings > 0:
            raise ValueError("llama3 rope_scaling: original_max_position_embeddings must be > 0, got "
                             f"{self.original_max_position_embeddings}")


def rope_inv_freq(head_dim: int, base: float, scaling: Llama3RopeScaling | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32: base^(-2i / head_dim), then, with `scaling`,
    Llama 3's rescaling (the arithmetic of transformers' llama3 rope initialisation, so both
    build bit-identical tables)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    s = scaling
    context = s.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    # Wavelengths longer than context / low_freq_factor are slowed down by `factor`; shorter
    # than context / high_freq_factor kept; in between, a linear blend in context / wavelen.
    slow = torch.where(wavelen > context / s.low_freq_factor, inv_freq / s.factor, inv_freq)
    blend = (context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - blend) * slow / s.factor + blend * slow
    between = (wavelen >= context / s.high_freq_factor) & (wavelen <= context / s.low_freq_factor)
    return torch.where(between, blended, slow)


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
