"""Random weights of realistic scale, for benchmarks without the real checkpoint
(LLM(load_format="dummy")); the model runner loads this module only then (core/runner_extras.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from nanovllm.model.quant import QuantScheme

_DUMMY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@torch.no_grad()
def init_dummy(model: nn.Module, seed: int = 0, scheme: QuantScheme | None = None) -> None:
    """Random weights of realistic scale (benchmarks without the real checkpoint); parameters in
    `scheme`'s stored format (FP8 codes, block scales) are drawn by their method (model/quant.py)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dtype not in _DUMMY_DTYPES or getattr(param, "block", None):
            continue
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)
    if scheme is not None:
        scheme.init_dummy(model, seed)
