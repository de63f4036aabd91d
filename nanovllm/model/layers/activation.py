"""The MLP's gated activation."""

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for the packed [..., 2 * d] output of gate_up_proj."""
    if x.is_cuda:  # one fused kernel instead of silu + mul (and their temporaries)
        from nanovllm.kernels.fused_ops import silu_and_mul as fused

        return fused(x)
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up
