"""Online FP8's decode steps with per-row activation scales written by the kernels that make each
GEMM input (kernels/fp8_rows.py), a `ForwardChain` of the decoder (model/decoder.py).

The layer-by-layer path quantizes each GEMM input with one scale per tensor, which takes an amax
over the whole tensor and a cast, two launches before every GEMM (~40% of what FP8 GEMMs save
at 64-256 rows on an H200, BENCHMARKS.md). Here, per layer:

    add_norm_quant(down' , s) -> codes, s -> qkv' = GEMM -> qk_norm_rope(row_scale=s) + KV store
    -> attention -> quantize_rows -> o' = GEMM -> add_norm_quant(o', s) -> gate_up' = GEMM
    -> silu_mul_quant(gate_up', s) -> down' = GEMM

each GEMM cuBLASLt's tensor-wise FP8 with activation scale 1 (out' = codes @ W_q^T * w_scale),
its rows multiplied by their scales in the kernel that reads them. One quantizing launch a layer
(attention's output) instead of eight. Per-row scales also round each token on its own scale:
an outlier token no longer coarsens the others' rounding, and a row's result no longer depends
on the batch it runs in.

Taken for decode steps (every row one cached token; v then goes to the cache only, scaled by the
q/k kernel) of dense models on one rank whose four projections are all online FP8 without bias,
in bf16 (CHAIN_DTYPES), with no layer hooks, and fused q/k norm + RoPE with the KV store.
Anything else takes the layer-by-layer forward. Values: tests/test_fp8_chain.py holds the same
arithmetic in torch.
"""

from __future__ import annotations

import torch

from nanovllm.kernels.fp8_rows import MAX_ROW, add_norm_quant, quantize_rows, silu_mul_quant
from nanovllm.kernels.qk_norm_rope import qk_norm_rope
from nanovllm.model.attention import AttentionMetadata
from nanovllm.model.fused_qk_norm_rope import store_args
from nanovllm.model.norm_chain import projections

_ONES: dict[torch.device, torch.Tensor] = {}  # the unit activation scale, one per device
# bf16 only: the GEMM's unscaled rows (codes up to 448 times the weights) could pass fp16's 65,504
# before their scale brings them back, where the per-tensor path scales in the GEMM's fp32 epilogue.
CHAIN_DTYPES = (torch.bfloat16,)


def gemm(codes: torch.Tensor, linear, dtype: torch.dtype) -> torch.Tensor:
    """codes @ W_q^T * w_scale in `dtype`: scaled_gemm on CUDA, the same product in fp32 elsewhere
    (the CPU tests; test_fp8_chain also runs the chain through scaled_gemm on CPU)."""
    if codes.is_cuda:
        return scaled_gemm(codes, linear, dtype)
    return ((codes.float() @ linear.weight.float().t()) * linear.weight_scale).to(dtype)


def scaled_gemm(codes: torch.Tensor, linear, dtype: torch.dtype) -> torch.Tensor:
    """torch._scaled_mm tensor-wise (cuBLASLt on CUDA) with activation scale 1: the rows' own
    scales are applied by the kernel that reads the output."""
    return torch._scaled_mm(codes, linear.weight.t(), unit_scale(codes.device), linear.weight_scale, out_dtype=dtype)


def unit_scale(device: torch.device) -> torch.Tensor:
    """The GEMMs' activation scale 1 on `device`, made at its first use. Fp8RowChain.operands makes
    it before a step runs the chain, so that it is never made inside a CUDA graph capture (its fill
    would run only when that graph replays)."""
    if device not in _ONES:
        _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return _ONES[device]


class Fp8RowChain:
    """The decoder forward of the module docstring; Fp8Config.quantize puts one in each
    DecoderModel's `chains` under online FP8."""

    def __init__(self, linear_method: type):
        self.linear_method = linear_method  # the projections' method this chain multiplies (TensorFp8Linear)

    def _takes(self, layer) -> bool:
        """Dense, one rank, online FP8 without bias, no hooks, fused q/k norm + RoPE, and rows the
        one-program-a-row kernels hold (fp8_rows: up to 32,768 elements)."""
        return (not (layer._forward_pre_hooks or layer._forward_hooks) and layer.self_attn.fused_rope
                and all(p is not None and p.tp_size == 1 and p.bias is None and type(p.quant) is self.linear_method
                        and p.in_features <= MAX_ROW for p in projections(layer)))

    def operands(self, model, hidden: torch.Tensor, meta: AttentionMetadata | None):
        """Each layer's KV-store arguments for a decode step the chain takes, else None."""
        if meta is None or meta.is_prefill or hidden.dim() != 2 or hidden.dtype not in CHAIN_DTYPES:
            return None
        if hidden.is_cuda and hidden.device not in _ONES:  # (unit_scale: never made inside a capture)
            if torch.cuda.is_current_stream_capturing():
                return None
            unit_scale(hidden.device)
        stores = []
        for layer in model.layers:
            store = store_args(layer.self_attn.attn, meta) if self._takes(layer) else {}
            if not store:
                return None
            stores.append(store)
        return stores

    def forward(self, model, ops: list, hidden: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x, x_scale, stream = hidden, None, None
        for layer, store in zip(model.layers, ops):
            norm = layer.input_layernorm
            (codes, scale), added = add_norm_quant(x, x_scale, stream, norm.weight, norm.eps)
            stream = added if stream is not None else hidden
            x, x_scale, stream = _layer(layer, store, codes, scale, stream, positions, meta)
        y, _ = add_norm_quant(x, x_scale, stream, model.norm.weight, model.norm.eps, quantize=False)
        return y


def _layer(layer, store: dict, codes, scale, stream, positions, meta):
    """One layer from its input norm's codes and row scales: (down', its row scales, the stream)."""
    attn, mlp, dtype = layer.self_attn, layer.mlp, stream.dtype
    qkv = gemm(codes, attn.qkv_proj, dtype)
    norms = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps) if attn.q_norm is not None else (None, None, 0.0)
    q, k, v = qk_norm_rope(qkv, norms[0], norms[1], attn.rotary_emb.cos_sin, positions, attn.num_heads,
                           attn.num_kv_heads, attn.head_dim, norms[2], row_scale=scale, **store)
    out = attn.attn(q, k, v, meta, kv_stored=True).reshape(-1, attn.q_size)  # v: unread in decode
    o_codes, o_scale = quantize_rows(out)
    o = gemm(o_codes, attn.o_proj, dtype)
    norm = layer.post_attention_layernorm
    (g_codes, g_scale), stream = add_norm_quant(o, o_scale, stream, norm.weight, norm.eps)
    d_codes, d_scale = silu_mul_quant(gemm(g_codes, mlp.gate_up_proj, dtype), g_scale)
    return gemm(d_codes, mlp.down_proj, dtype), d_scale, stream

