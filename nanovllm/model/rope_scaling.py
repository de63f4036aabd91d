"""Llama 3.1's RoPE frequency scaling (rope_type "llama3" in config.json). model/decoder.py reaches
it through LLAMA3_ROPE_SCALING, which nanovllm/wiring/ fills at import: a model without it never
loads this module."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


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

    @classmethod
    def from_params(cls, params: dict) -> Llama3RopeScaling:
        """From config.json's rope parameters (decoder.py's rope_of); a missing key is a ValueError."""
        missing = [k for k in _KEYS if params.get(k) is None]
        if missing:
            raise ValueError(f"rope_type 'llama3' needs {', '.join(missing)} in rope_scaling")
        return cls(float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"]),
                   int(params["original_max_position_embeddings"]))

    def rescale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Plain RoPE's inverse frequencies (fp32) rescaled: the arithmetic of transformers' llama3
        rope initialisation, so both build bit-identical tables."""
        context = self.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        # Wavelengths longer than context / low_freq_factor are slowed down by `factor`; shorter
        # than context / high_freq_factor kept; in between, a linear blend in context / wavelen.
        slow = torch.where(wavelen > context / self.low_freq_factor, inv_freq / self.factor, inv_freq)
        blend = (context / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        blended = (1 - blend) * slow / self.factor + blend * slow
        between = (wavelen >= context / self.high_freq_factor) & (wavelen <= context / self.low_freq_factor)
        return torch.where(between, blended, slow)
