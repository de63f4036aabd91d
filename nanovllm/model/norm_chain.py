"""The decoder's one-row forward with each RMSNorm folded into the GEMVs around it (CUDA, one
16-bit row: batch-1 decode). o_proj and down_proj add the residual in their epilogue and write
each program's sum of squares of the new residual stream (dense_gemv's `add_residual`); qkv and
gate_up norm that stream from those sums in their prologue (`Prologue.NORM_PARTS`); SiLU * up is
gate_up's epilogue. Per layer: qkv,
attention, o, gate_up, down, without the two add + RMSNorm kernels between them (~2 us and a
launch gap each on the H200, BENCHMARKS.md "Batch-1 steps").

Values: the residual adds and the norm's two roundings are the unfused path's; only the sum of
squares is added in another order (an fp32 ulp of the norm's scale at most). Loaded at first use
(decoder.py's NORM_CHAIN) for models it finds `operands` for: dense layers on one rank, 16-bit or with a
quantization method that offers the GEMV its operands (FP8's `gemv_operands`), without layer
hooks, with qkv and gate_up within CHAIN_MAX_BYTES; LoRA, INT4, MoE, tensor parallelism and
EAGLE-3's kept layer inputs take the layer-by-layer forward."""

from __future__ import annotations

import torch

from nanovllm.kernels.dense_gemv import Prologue, dense_gemv
from nanovllm.model.attention import AttentionMetadata

# The norm prologue is recomputed by each of qkv's and gate_up's programs, so it pays on small
# weights only. Measured in the engine (H100, 2026-12-05, bench_decode_step.py, batch 1): the chain
# took Qwen3-0.6B's step from 1.212 to 1.139 ms (qkv 8 MB, gate_up 12 MB) but Qwen3-8B FP8's
# from 3.969 to 4.238 (25 MB, 100 MB).
CHAIN_MAX_BYTES = 16 << 20


def _operands(linear) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, scale) the GEMV multiplies for a projection on one rank: its 16-bit weight, or
    what its quantization method offers (`gemv_operands`: FP8's codes and scales); else None."""
    if linear is None or linear.tp_size != 1:
        return None
    if linear.quant is None:
        return linear.weight, None
    offer = getattr(linear.quant, "gemv_operands", None)
    return offer(linear) if offer is not None else None


def _projections(layer) -> list:
    mlp = layer.mlp
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, getattr(mlp, "gate_up_proj", None),
            getattr(mlp, "down_proj", None)]


def operands(model, hidden: torch.Tensor) -> list | None:
    """Each layer's four (weight, scale) pairs if `model` (a DecoderModel) takes the chained
    forward for this embedded row, else None (checked once a forward, then used as found)."""
    if hidden.dim() != 2 or hidden.shape[0] != 1 or hidden.dtype not in (torch.bfloat16, torch.float16):
        return None
    found = []
    for layer in model.layers:
        ops = [_operands(p) for p in _projections(layer)]
        if layer._forward_pre_hooks or layer._forward_hooks or None in ops:
            return None
        if max(ops[0][0].nbytes, ops[2][0].nbytes) > CHAIN_MAX_BYTES:
            return None
        gate_up, scale = ops[2]
        if scale is not None and scale.dim() == 2 and (gate_up.shape[0] // 2) % 128:
            return None  # block scales: gate and up must start on a block row (silu_mul)
        found.append(ops)
    return found


def _layer(layer, ops: list, positions: torch.Tensor, stream: torch.Tensor, parts: torch.Tensor,
           meta: AttentionMetadata):
    """One decoder layer on the residual stream (and its sums of squares), its projections'
    (weight, scale) `ops`: the next (stream, parts)."""
    qkv_proj, o_proj, gate_up_proj, down_proj = _projections(layer)
    (w_qkv, s_qkv), (w_o, s_o), (w_gu, s_gu), (w_down, s_down) = ops
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    qkv = dense_gemv(stream, w_qkv, scale=s_qkv, bias=qkv_proj.bias, prologue=Prologue.NORM_PARTS,
                     norm_weight=norm1.weight, eps=norm1.eps, norm_parts=parts)
    stream, parts = dense_gemv(layer.self_attn.attend(positions, qkv, meta), w_o, scale=s_o, bias=o_proj.bias,
                               add_residual=stream)
    act = dense_gemv(stream, w_gu, scale=s_gu, bias=gate_up_proj.bias, silu_mul=True,
                     prologue=Prologue.NORM_PARTS, norm_weight=norm2.weight, eps=norm2.eps, norm_parts=parts)
    return dense_gemv(act, w_down, scale=s_down, bias=down_proj.bias, add_residual=stream)


def forward(model, ops: list, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The final normed hidden state [1, hidden] from the embedded row `hidden`; `ops`: `operands`'."""
    stream, parts = hidden, hidden.float().square().sum(-1)  # layer 0 norms the embedding
    for layer, layer_ops in zip(model.layers, ops):
        stream, parts = _layer(layer, layer_ops, positions, stream, parts, meta)
    return model.norm(stream)
