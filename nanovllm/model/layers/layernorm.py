"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from nanovllm.parallel.group import current_tp_group


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in fp32 (Qwen3 / transformers rounding)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.tp = current_tp_group()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(dtype) * self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, all_reduce: bool = False):
        """norm(x), or with `residual` (norm(x + residual), x + residual), the sum rounded to x's dtype
        first (transformers'). `all_reduce`: x is a partial sum over the TP ranks (DistributedTPGroup)."""
        if all_reduce and self.tp.size > 1:
            return self.tp.rms_norm(x, residual, self)
        if x.is_cuda:
            from nanovllm.kernels.fused_ops import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
