"""Vocabulary-parallel token embedding and LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.parallel.group import current_tp_group


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary's rows (the last one may be padded)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp = current_tp_group()
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        self.num_embeddings = num_embeddings
        # Ceil so any vocabulary size (odd ones too) splits; padded rows are never looked up.
        self.shard_size = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.shard_size * self.tp_rank
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
        expected = (self.num_embeddings, param.size(1))
        if tuple(loaded.shape) != expected:
            raise ValueError(f"{name}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {expected}")
        shard = loaded[self.vocab_start:self.vocab_start + self.shard_size]
        param.data[:shard.size(0)].copy_(shard)
        param.data[shard.size(0):].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.embedding(x, self.weight) if self.tp_size == 1 else self.tp.embed(x, self)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the whole vocabulary; each rank computes its slice, rank 0 gathers them."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = F.linear(hidden, self.weight)
        return logits[:, :self.num_embeddings] if self.tp_size == 1 else self.tp.gather_logits(logits, self)
