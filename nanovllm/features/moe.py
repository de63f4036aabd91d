"""Mixture-of-experts MLP (Qwen3-MoE): a softmax top-k router and SwiGLU experts stacked per layer.

Experts live in two stacked parameters, the layout the fused-MoE kernel takes:
`w13` [E, 2 * I, H] (each expert's gate_proj rows, then its up_proj rows) and `w2` [E, H, I].
Tensor parallelism splits every expert's intermediate dimension I, like the dense MLP: a rank
holds rows [r * I/tp, (r + 1) * I/tp) of gate and of up, and the same columns of down, so its
output is a partial sum that the next RMSNorm all-reduces (reduce_results=False). The router is
replicated: every rank routes the same (all-reduced) hidden states to the same experts.
Block-FP8 experts (Qwen3-*-FP8 checkpoints, or `quantization="fp8"`) keep the same layout in
float8_e4m3fn plus stacked 128x128 block scales: features/quantization/fp8_moe.py.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.model.layers.activation import silu_and_mul
from nanovllm.kernels.fp8_format import FP8_DTYPE
from nanovllm.model.layers.linear import ReplicatedLinear
from nanovllm.model.quant import QuantMethod
from nanovllm.parallel.group import current_tp_group, divide


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of transformers' Qwen3-MoE router, operation for operation: softmax over the
    experts in fp32, the `top_k` largest probabilities per token, with `renormalize`
    (norm_topk_prob) those divided by their sum, then rounded to the logits' dtype as
    transformers does (held in fp32: exactly its routing scores).

    router_logits: [T, E] float. Returns (topk_weights fp32 [T, top_k], topk_ids int32
    [T, top_k]); ids of one token are distinct, ordered by falling weight.
    """
    if not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 2:
        raise ValueError(f"router_logits must be a [tokens, experts] tensor, got {getattr(router_logits, 'shape', router_logits)}")
    if not router_logits.is_floating_point():
        raise TypeError(f"router_logits must be a float tensor, got {router_logits.dtype}")
    num_experts = router_logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k!r} must be an int in [1, {num_experts}] (the number of experts)")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype).float(), ids.to(torch.int32)


def _check_moe_args(hidden, w13, w2, topk_weights, topk_ids) -> None:
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"hidden must be [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(hidden.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    (t, h), (e, two_i, h13), (e2, h2, i) = hidden.shape, w13.shape, w2.shape
    if h13 != h or h2 != h or e2 != e or two_i != 2 * i:
        raise ValueError(f"inconsistent MoE shapes: hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)} (need w13 [E, 2I, H] and w2 [E, H, I])")
    if topk_weights.shape != topk_ids.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} "
                         f"must both be [{t}, k]")
    if w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError(f"expert weights ({w13.dtype}, {w2.dtype}) must have hidden's dtype {hidden.dtype}")


def _expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert on rows x: down(silu(gate(x)) * up(x)), in x's dtype."""
    return F.linear(silu_and_mul(F.linear(x, w13)), w2)


def moe_torch(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, dense: bool | None = None) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]) for every token t: [T, H].

    hidden [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_weights [T, k]
    (fp32); topk_ids [T, k] (ints in [0, E)). Each expert runs in hidden's dtype; the weighted
    sum is accumulated in fp32, expert by expert in increasing id, and rounded once at the end.
    The same function as `nanovllm.kernels.fused_moe.fused_moe`, in plain torch.

    Sparse (default): only the experts that got tokens run, on their tokens; that needs the
    routing on the host (a sync). Dense (default while a CUDA graph is being captured, which
    allows no sync): every expert runs on every token as batched GEMMs over groups of experts,
    weighted 0 where it was not chosen (the group's weighted sum is one fp32 contraction, so the
    order of the additions differs from the sparse path's). E / k times the work: CUDA uses the
    fused kernel instead (fused_experts); this path is its reference in the GPU tests.
    """
    _check_moe_args(hidden, w13, w2, topk_weights, topk_ids)
    num_experts = w13.shape[0]
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    weights = topk_weights.float()
    if dense is None:
        dense = hidden.is_cuda and torch.cuda.is_current_stream_capturing()
    if dense:
        # [E, T]: token t's weight for expert e, 0 where e is not among its top-k.
        per_expert = torch.zeros(hidden.shape[0], num_experts, dtype=torch.float32, device=hidden.device)
        per_expert = per_expert.scatter_add(1, topk_ids.long(), weights).t()
        # Groups small enough that a group's fp32 outputs stay around 64 MiB.
        group = max(1, min(num_experts, (64 << 20) // max(1, 4 * hidden.numel())))
        for start in range(0, num_experts, group):
            experts = slice(start, start + group)
            act = silu_and_mul(torch.matmul(hidden, w13[experts].transpose(1, 2)))  # [g, T, I]
            y = torch.matmul(act, w2[experts].transpose(1, 2))  # [g, T, H]
            out += torch.einsum("gt,gth->th", per_expert[experts], y.float())
        return out.to(hidden.dtype)
    flat = topk_ids.reshape(-1).long()
    if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < num_experts:
        raise ValueError(f"topk_ids must be in [0, {num_experts})")
    order = torch.argsort(flat, stable=True)  # token slots grouped by expert
    tokens = order // topk_ids.shape[1]
    slot_weights = weights.reshape(-1)[order]
    start = 0
    for e, n in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
        if n:
            rows = tokens[start:start + n]
            y = _expert(hidden[rows], w13[e], w2[e]).float() * slot_weights[start:start + n, None]
            out.index_add_(0, rows, y)
            start += n
    return out.to(hidden.dtype)


@functools.cache
def _fused_moe_kernel():
    """The Triton fused-MoE kernel (`nanovllm.kernels.fused_moe.fused_moe`), or None while that
    module does not exist."""
    try:
        from nanovllm.kernels.fused_moe import fused_moe
    except ImportError:
        return None
    return fused_moe


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """The 16-bit experts' weighted sum (see moe_torch): the one place that picks the
    implementation, the fused Triton kernel on CUDA when it is available, else plain torch.
    (Quantized experts go through their method: ExpertsMethod.apply.)"""
    if hidden.is_cuda:
        kernel = _fused_moe_kernel()
        if kernel is not None:
            return kernel(hidden, w13, w2, topk_weights, topk_ids)
    return moe_torch(hidden, w13, w2, topk_weights, topk_ids)


class ExpertsMethod(QuantMethod, Protocol):
    """A quantization method of MoeExperts (model/quant.py's hook, quant_kind "experts"; e.g.
    features/quantization/fp8_moe.py): their weighted sum from the stored weights."""

    def apply(self, experts: "MoeExperts", hidden: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor: ...


class MoeExperts(nn.Module):
    """E SwiGLU experts of intermediate size I, this rank's slice of each: w13 [E, 2 * I/tp, H]
    and w2 [E, H, I/tp].

    Weight loading (shard ids, see nanovllm/model/loader.py): (e, 0) / (e, 1) take expert e's
    gate_proj / up_proj [I, H] into w13, (e, 0) its down_proj [H, I] into w2, and "fused" the
    stacked 3-D form transformers keeps in memory ([E, 2I, H] gate_up_proj, [E, H, I] down_proj).
    With block-FP8 experts (`quant`, set before loading: features/quantization/fp8_moe.py) w13 / w2
    are float8_e4m3fn and `w13_scale_inv` / `w2_scale_inv` hold their 128x128 block scales,
    stacked and sharded the same way from each projection's `weight_scale_inv` (counted in
    blocks); without FP8 they are None.
    """

    quant_kind = "experts"  # what a quantization scheme sees (model/quant.py)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        tp = current_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        shard = divide(intermediate_size, tp.size)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * shard, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, shard), requires_grad=False)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader
        self.register_parameter("w13_scale_inv", None)
        self.register_parameter("w2_scale_inv", None)
        self.quant = None  # its QuantMethod (model/quant.py) when quantized, set before loading

    def _expert_index(self, shard_id, name: str) -> int:
        e = shard_id[0]
        if not 0 <= e < self.num_experts:
            raise ValueError(f"{name}: expert {e} but the model has {self.num_experts} experts (num_experts)")
        return e

    @staticmethod
    def _check(param: torch.Tensor, loaded: torch.Tensor, expected: tuple, name: str) -> None:
        if tuple(loaded.shape) != expected:
            raise ValueError(f"{name}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {expected}")
        if (param.dtype == FP8_DTYPE) != (loaded.dtype == FP8_DTYPE):
            # A cast between FP8 codes and real values would load garbage without a word.
            raise ValueError(f"{name}: checkpoint tensor is {loaded.dtype}, expected {param.dtype} "
                             f"(config.json's quantization_config and the tensors disagree)")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "", shard_id=None) -> None:
        # Block-scale parameters count rows and columns in 128-blocks (this rank's share of I is
        # whole blocks: checked when the FP8 parameters were made).
        unit = getattr(param, "block", None) or 1
        E, H, I = self.num_experts, -(-self.hidden_size // unit), -(-self.intermediate_size // unit)
        n = I // self.tp_size
        cols = slice(self.tp_rank * n, (self.tp_rank + 1) * n)  # this rank's slice of I
        if param is self.w13 or param is self.w13_scale_inv:
            if shard_id == "fused":
                self._check(param, loaded, (E, 2 * I, H), name)
                param.data[:, :n].copy_(loaded[:, :I][:, cols])
                param.data[:, n:].copy_(loaded[:, I:][:, cols])
            else:
                e = self._expert_index(shard_id, name)
                self._check(param, loaded, (I, H), name)
                param.data[e, shard_id[1] * n:(shard_id[1] + 1) * n].copy_(loaded[cols])
        elif param is self.w2 or param is self.w2_scale_inv:
            if shard_id == "fused":
                self._check(param, loaded, (E, H, I), name)
                param.data.copy_(loaded[:, :, cols])
            else:
                e = self._expert_index(shard_id, name)
                self._check(param, loaded, (H, I), name)
                param.data[e].copy_(loaded[:, cols])
        else:
            raise ValueError(f"{name}: not a parameter of this experts module")

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.apply(self, hidden, topk_weights, topk_ids)
        return fused_experts(hidden, self.w13, self.w2, topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    """Router (`gate`, replicated, no bias) -> softmax top-k (-> renormalised) -> experts.

    Returns this rank's partial sum [T, H]: the RMSNorm after it all-reduces (as after the dense
    MLP's down_proj with reduce_results=False).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 norm_topk_prob: bool):
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        # The router stays 16-bit under every scheme (as in vLLM's Qwen3-MoE; Qwen's FP8 MoE
        # checkpoints store it in bf16 and list it in modules_to_not_convert).
        self.gate.quant_kind = None
        self.experts = MoeExperts(num_experts, hidden_size, intermediate_size)

    @classmethod
    def from_options(cls, hidden_size: int, moe) -> "SparseMoeBlock":
        """The block of a decoder layer (model/decoder.py's `SparseMlpFactory`) from its MoeOptions."""
        return cls(hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = route_topk(self.gate(hidden), self.top_k, self.norm_topk_prob)
        return self.experts(hidden, weights, ids)
