"""DecoderAttention's fused path (CUDA tensors, or Triton's interpreter in tests): one kernel for
(q/k RMSNorm +) RoPE of every head instead of ~15 small ones, which also writes k and v into the
paged cache when the attention layer lets it (a launch less). Loaded at first use (decoder.py's
FUSED_QK_NORM_ROPE)."""

from __future__ import annotations

import torch

from nanovllm.kernels.qk_norm_rope import qk_norm_rope
from nanovllm.model.attention import Attention, AttentionMetadata


def store_args(attn: Attention, meta: AttentionMetadata) -> dict:
    """Keyword arguments that make `qk_norm_rope` store this step's K/V into the layer's cache
    (then the layer is called with kv_stored=True), or {} when the layer must store them itself:
    no cache yet (the start-up forwards), or a prefill that first calibrates the FP8 scales."""
    if not attn.k_cache.numel() or (attn.calibrate_next_prefill is not None and meta.is_prefill):
        return {}
    args = dict(k_cache=attn.k_cache, v_cache=attn.v_cache, slot_mapping=meta.slot_mapping)
    if attn.k_cache.dtype == torch.float8_e4m3fn:
        args.update(k_scale=attn.k_scale, v_scale=attn.v_scale)
    return args


def qkv_heads(layer, qkv: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
    """(q, k, v, kv_stored) of a DecoderAttention `layer` from its packed qkv projection: q and k
    normed (when the layer has q/k norms) and rotated; kv_stored when the kernel cached k and v."""
    norms = (layer.q_norm.weight, layer.k_norm.weight, layer.q_norm.eps) if layer.q_norm is not None \
        else (None, None, 0.0)
    store = store_args(layer.attn, meta)
    q, k, v = qk_norm_rope(qkv, norms[0], norms[1], layer.rotary_emb.cos_sin, positions,
                           layer.num_heads, layer.num_kv_heads, layer.head_dim, norms[2], **store)
    return q, k, v, bool(store)
