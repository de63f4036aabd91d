"""The hook through which a whole-model forward replaces the decoder's layer-by-layer one for the
steps it takes (DecoderModel.forward, on CUDA): batch 1's norms folded into its GEMVs
(model/norm_chain.py, always tried first), or a chain a feature puts in `DecoderModel.chains`
(features/quantization/fp8_chain.py: online FP8's decode steps with per-row activation scales)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from nanovllm.model.attention import AttentionMetadata


class ForwardChain(Protocol):
    """`model`: the DecoderModel running the step."""

    def operands(self, model: nn.Module, hidden: torch.Tensor, meta: AttentionMetadata):
        """What `forward` needs for this step (embedded rows `hidden`), or None to decline it."""

    def forward(self, model: nn.Module, ops, hidden: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """The final normed hidden states, as the layer-by-layer forward returns them."""
