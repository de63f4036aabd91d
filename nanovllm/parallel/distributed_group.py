"""A tensor-parallel group of several ranks over torch.distributed, with the all-reduce paths it
can use (fused_all_reduce.py, copy_engine.py). create_group.py makes one on every rank of a
tensor-parallel launch; a single-rank engine never loads this module (group.py's TPGroup)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanovllm.parallel.group import TPGroup

if TYPE_CHECKING:
    from nanovllm.parallel.copy_engine import CopyEngineAllReduce
    from nanovllm.parallel.fused_all_reduce import FusedAllReduceNorm


def _matmul_into(layer, x: torch.Tensor, out: torch.Tensor) -> None:
    """out = x @ W^T (no bias) of a LinearBase, written into `out` (the copy-engine all-reduce's chunks)."""
    if layer.quant is None:
        torch.mm(x, layer.weight.t(), out=out)
    else:
        out.copy_(layer.quant.apply(layer, x, None))


@dataclass(frozen=True)
class DistributedTPGroup(TPGroup):
    """One rank's view of its tensor-parallel group and the all-reduce paths it can use."""

    group: object = None  # a torch.distributed ProcessGroup
    fused_norm: "FusedAllReduceNorm | None" = None  # fast path for small (<= 8 MiB) CUDA tensors
    copy_engine: "CopyEngineAllReduce | None" = None  # prefill-sized partial sums at TP=2

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def row_parallel(self, x: torch.Tensor, layer) -> torch.Tensor:
        """This rank's partial sums x @ W^T of a row-parallel layer (a LinearBase, no bias). The
        caller must hand this very tensor to `all_reduce_rms_norm`: prefill-sized ones may
        already be on their way to the peer, and that call finishes the exchange."""
        ce = self.copy_engine  # (not for a layer whose rows need their positions: LoRA's, row_chunks False)
        if ce is not None and getattr(layer, "row_chunks", True) and ce.takes(x, layer.out_features):
            return ce.linear(x, lambda a, out: _matmul_into(layer, a, out))
        return layer.matmul(x)

    def all_reduce_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        """(norm(s + residual) * weight, s + residual) with s = the sum of `x` over the ranks,
        through the copy-engine exchange that `row_parallel` started for `x`, or the fused
        kernel when `x` fits its buffers; None otherwise (the caller all-reduces and normalises
        separately)."""
        if self.copy_engine is not None and self.copy_engine.is_pending(x):
            return self.copy_engine.finish(x, residual, weight, eps)
        if self.fused_norm is not None and self.fused_norm.fits(x, residual):
            return self.fused_norm(x, residual, weight, eps)
        return None

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
        """An RMSNorm's `norm(s, residual)` (model/layers/layernorm.py) with s = the sum of `x` over
        the ranks: one of the fused paths above where it applies, else NCCL, then the norm."""
        fused = self.all_reduce_rms_norm(x, residual, norm.weight, norm.eps)
        return fused if fused is not None else norm(self.all_reduce(x), residual)

    def embed(self, x: torch.Tensor, layer) -> torch.Tensor:
        """A VocabParallelEmbedding's lookup: each rank's rows for the ids in its slice, summed over the ranks."""
        local = x - layer.vocab_start
        mask = (local >= 0) & (local < layer.shard_size)
        y = F.embedding(local.clamp(0, layer.shard_size - 1), layer.weight) * mask.unsqueeze(-1).to(layer.weight.dtype)
        return self.all_reduce(y)

    def gather_logits(self, logits: torch.Tensor, head) -> torch.Tensor | None:
        """A ParallelLMHead's logits over the whole vocabulary on rank 0 (None on the others)."""
        parts = self.gather_to_rank0(logits)
        return None if parts is None else torch.cat(parts, dim=-1)[:, :head.num_embeddings]

    def symmetric_memory_bytes(self) -> int:
        """Device memory held by the symmetric-memory paths (not in the caching allocator's count)."""
        return sum(p.symmetric_memory_bytes() for p in (self.fused_norm, self.copy_engine) if p is not None)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x`, stacked in rank order: [size, *x.shape] on every rank."""
        if self.size == 1:
            return x[None]
        parts = [torch.empty_like(x) for _ in range(self.size)]
        # The list form: all_gather_into_tensor is deprecated in torch 2.13 and gloo wants other
        # shapes there; for the small tensors this serves, the copies do not matter.
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.stack(parts)

    def gather_to_rank0(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `x` on rank 0 (in rank order); None on the other ranks."""
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return parts

    def broadcast_from_rank0(self, x: torch.Tensor) -> None:
        """Rank 0's `x` on every rank, in place."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.group)

    def agree_on_min(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (e.g. KV blocks that fit on every GPU)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())
