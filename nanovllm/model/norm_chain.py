"""The decoder's one-row forward with each RMSNorm folded into the GEMVs around it (CUDA, one
bf16 row: batch-1 decode). o_proj and down_proj add the residual in their epilogue and write the
new residual stream s, s times the next norm's weight and each program's sum of s^2
(`add_residual`, `next_norm_weight`); qkv and gate_up multiply that product and scale their
outputs by rsqrt(mean(s^2) + eps) from those sums (`norm_parts`); SiLU * up is gate_up's epilogue.
Per layer: qkv, attention, o, gate_up, down, without the two add + RMSNorm kernels between them
(~2 us and a launch gap each, BENCHMARKS.md "Batch-1 steps"). The GEMVs are kernels/dense_gemv.py
(16-bit, FP8) and kernels/w4a16_gemv.py (INT4), whichever the projection's weights take.

Values: the residual adds are the unfused path's, bit for bit. The norm is not rounded where the
unfused kernel rounds s * rsqrt to 16 bits before the weight: here s * weight is rounded and the
rsqrt multiplies the fp32 sums, so each normed input may differ from the unfused one by one
rounding (2^-8 relative in bf16), which moves an output by about one of its own roundings now and
then. In return neither GEMV does per-element work for the norm, so the fold serves weights of any
size (normalizing x in every program, as before, cost more than the kernel it saved above ~16 MB).
A bias is added in fp32 before the output's one rounding (as cuBLAS's epilogue does for 16-bit
weights; INT4's layer-by-layer path rounds the product first, so one rounding apart there).
Measured (H100, one call, BENCHMARKS.md "Batch-1 steps"): Qwen3-8B's step 1.5% (bf16), 0.9% (FP8)
and 2.0% (INT4) faster; Qwen3-0.6B's 0.4-0.8% slower (three runs) than the exact per-element
prologue it replaced. bf16 only (CHAIN_DTYPES): s * weight is rounded before the rsqrt scales it,
so in fp16 an element past its range (|s * w| > 65504: a stream of a few thousand times a norm
weight of tens, which real checkpoints hold) would overflow where the unfused norm, rounding s *
rsqrt first, does not; bf16's range is fp32's.

Loaded at first use (decoder.py's NORM_CHAIN) for models it finds `operands` for: dense layers
on one rank, 16-bit or with a quantization method that offers the GEMV its operands
(`gemv_operands`: FP8's codes and scales, INT4's Int4Operands), without layer hooks; LoRA, MoE,
tensor parallelism and EAGLE-3's kept layer inputs take the layer-by-layer forward."""

from __future__ import annotations

import torch

from nanovllm.kernels.dense_gemv import Prologue, dense_gemv
from nanovllm.kernels.fused_ops import norm_parts
from nanovllm.kernels.w4a16_gemv import Int4Operands, gated_fits
from nanovllm.kernels.w4a16_gemv import gemv as int4_gemv
from nanovllm.model.attention import AttentionMetadata

CHAIN_DTYPES = (torch.bfloat16,)  # the dtypes whose range holds s * weight (the docstring's fp16 overflow)


def _operands(linear):
    """What the GEMV multiplies for a projection on one rank: (16-bit weight, None), or what its
    quantization method offers (`gemv_operands`: FP8's (codes, scale), INT4's Int4Operands); else None."""
    if linear is None or linear.tp_size != 1:
        return None
    if linear.quant is None:
        return linear.weight, None
    offer = getattr(linear.quant, "gemv_operands", None)
    return offer(linear) if offer is not None else None


def projections(layer) -> list:
    """A decoder layer's qkv, o, gate_up and down projections (None for an MoE block's two)."""
    mlp = layer.mlp
    return [layer.self_attn.qkv_proj, layer.self_attn.o_proj, getattr(mlp, "gate_up_proj", None),
            getattr(mlp, "down_proj", None)]


def _gate_up_fits(op) -> bool:
    """Whether gate_up's GEMV can write SiLU * up: INT4 in whole gate / up runs of its strips;
    FP8 block scales with gate and up each starting on a block row."""
    if isinstance(op, Int4Operands):
        return gated_fits(op.qweight.shape[1], op.cfg)
    weight, scale = op
    return scale is None or scale.dim() != 2 or (weight.shape[0] // 2) % 128 == 0


def operands(model, hidden: torch.Tensor, meta: AttentionMetadata | None = None) -> list | None:
    """Each layer's four projections' operands if `model` (a DecoderModel) takes the chained
    forward for this embedded row, else None (checked once a forward, then used as found; any
    one-row step is taken, so `meta` is not read)."""
    if hidden.dim() != 2 or hidden.shape[0] != 1 or hidden.dtype not in CHAIN_DTYPES:
        return None
    found = []
    for layer in model.layers:
        ops = [_operands(p) for p in projections(layer)]
        if layer._forward_pre_hooks or layer._forward_hooks or None in ops or not _gate_up_fits(ops[2]):
            return None
        found.append(ops)
    return found


def _gemv(x: torch.Tensor, op, linear, **folds):
    """One projection's GEMV with its folds (silu_mul; add_residual + next_norm_weight; norm_parts + eps)."""
    if isinstance(op, Int4Operands):
        if op.perm is not None:  # act-order: x's columns in the order of the packed rows
            x = x.index_select(-1, op.perm)
        return int4_gemv(x, op.qweight, op.scales, op.zeros, op.group_size, op.cfg, bias=linear.bias, **folds)
    weight, scale = op
    if "norm_parts" in folds:
        folds["prologue"] = Prologue.NORM_PARTS
    return dense_gemv(x, weight, scale=scale, bias=linear.bias, **folds)


def _layer(layer, ops: list, positions: torch.Tensor, x: torch.Tensor, stream: torch.Tensor, parts: torch.Tensor,
           meta: AttentionMetadata, next_norm: torch.Tensor | None):
    """One decoder layer on x (the residual stream times the input norm's weight), the stream and
    its sums of squares: the next (stream, parts, x for the norm `next_norm`, or None)."""
    qkv_proj, o_proj, gate_up_proj, down_proj = projections(layer)
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    qkv = _gemv(x, ops[0], qkv_proj, norm_parts=parts, eps=norm1.eps)
    stream, parts, x = _gemv(layer.self_attn.attend(positions, qkv, meta), ops[1], o_proj, add_residual=stream,
                             next_norm_weight=norm2.weight)
    act = _gemv(x, ops[2], gate_up_proj, silu_mul=True, norm_parts=parts, eps=norm2.eps)
    return _gemv(act, ops[3], down_proj, add_residual=stream, next_norm_weight=next_norm)


def forward(model, ops: list, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The final normed hidden state [1, hidden] from the embedded row `hidden`; `ops`: `operands`'."""
    layers = model.layers
    parts, x = norm_parts(hidden, layers[0].input_layernorm.weight)  # layer 0's norm, of the embedding
    stream = hidden
    for i, (layer, layer_ops) in enumerate(zip(layers, ops)):
        next_norm = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else None
        stream, parts, x = _layer(layer, layer_ops, positions, x, stream, parts, meta, next_norm)
    return model.norm(stream)
