"""The attention backend of CUDA without flash-attn: PyTorch's bundled FlashAttention-2 varlen
kernel for prefills without cached tokens, our paged prefill kernel (kernels/paged_prefill.py)
for those with cached tokens (it reads the cache in place; big query chunks gather the contexts
for FlashAttention-2 instead, gathered_prefill.py), our Triton split-KV kernel
(kernels/paged_decode.py) for decode, the Triton store kernel (kernels/kv_store.py) for the
paged cache."""

from __future__ import annotations

import dataclasses

import torch

from nanovllm.kernels.kv_store import store_kvcache
from nanovllm.kernels.paged_decode import paged_decode_attention
from nanovllm.kernels.paged_prefill import paged_prefill_attention
from nanovllm.model.attention.fp8_cache import fp8_kv, round_trip_kv
from nanovllm.model.attention.gathered_prefill import flash_varlen, gathered_prefill
from nanovllm.model.attention.metadata import AttentionMetadata
from nanovllm.model.attention.torch_backend import TorchBackend


def prefill_part(meta: AttentionMetadata) -> AttentionMetadata:
    """A mixed step's metadata for its prefill sequences alone (all but the trailing
    num_decode_rows, whose tokens come first in the packing)."""
    p = len(meta.query_lens) - meta.num_decode_rows
    ql, kl = meta.query_lens[:p], meta.kv_lens[:p]
    return dataclasses.replace(
        meta, slot_mapping=meta.slot_mapping[:sum(ql)], context_lens=meta.context_lens[:p],
        block_tables=meta.block_tables[:p], cu_seqlens_q=meta.cu_seqlens_q[:p + 1],
        cu_seqlens_k=meta.cu_seqlens_k[:p + 1], max_seqlen_q=max(ql), max_seqlen_k=max(kl),
        has_prefix=kl != ql, query_lens=ql, kv_lens=kl, num_decode_rows=0)


class TritonBackend:
    """CUDA without flash-attn: aten's FlashAttention-2 varlen prefill, Triton paged prefill
    (cached tokens) and decode."""

    name = "triton"
    fp8_cache = True
    # Prefills with cached tokens and at most this many new tokens a sequence read the cache in
    # place; longer chunks gather for FlashAttention-2. H100 (BENCHMARKS.md): the paged kernel
    # 1.04-2.8x faster up to 2,048 new tokens (FP8: 0.97x at 2,048), 0.93x (FP8 0.78x) at 8,192.
    PAGED_PREFILL_MAX_Q = 2048

    def __init__(self):
        self._decode = paged_decode_attention
        self._reference = TorchBackend()

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    @staticmethod
    def warm_up(model, dtype: torch.dtype) -> None:
        """At start-up, compile what steps would otherwise compile inside a run: the paged prefill
        for the model's cache (a prefix hit's first) and the decode kernel for a mixed step's
        decode rows, whose table is as wide as the step's longest (decode graphs compile only the
        full width). One launch per block-table width and split count Triton tells apart (1, a
        multiple of 16, another), on fresh aligned tensors as the steps' are."""
        layer = next((m for m in model.modules() if isinstance(getattr(m, "k_cache", None), torch.Tensor)
                      and m.k_cache.numel()), None)
        if layer is None or dtype == torch.float32:  # fp32 prefills take the reference
            return
        fp8 = layer.k_cache.dtype == torch.float8_e4m3fn
        scales = (layer.k_scale, layer.v_scale) if fp8 else (None, None)
        dev = layer.k_cache.device
        q = torch.zeros(1, layer.num_heads, layer.head_dim, dtype=dtype, device=dev)
        cu, ctx = torch.tensor([0, 1], dtype=torch.int32, device=dev), torch.ones(1, dtype=torch.int32, device=dev)
        for width in (1, 16, 3):
            table = torch.zeros(1, width, dtype=torch.int32, device=dev)
            paged_prefill_attention(q, layer.k_cache, layer.v_cache, table, cu, ctx, 1, layer.scale, *scales)
        # Widths wide enough for 16 splits of the largest tile (128 tokens): paged_decode takes no
        # more splits than a table holds tiles.
        wide = 16 * -(-128 // layer.k_cache.shape[1])
        for width in (1, wide, wide + 1):
            table = torch.zeros(1, width, dtype=torch.int32, device=dev)
            for splits in (1, 16, 3):
                paged_decode_attention(q, layer.k_cache, layer.v_cache, table, ctx, layer.scale, splits, None, *scales)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                k_scale=None, v_scale=None) -> torch.Tensor:
        if not meta.is_prefill:
            return self._decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                num_splits=meta.num_splits, k_scale=k_scale, v_scale=v_scale)
        if meta.num_decode_rows:
            return self._mixed(q, k, v, k_cache, v_cache, meta, scale, k_scale, v_scale)
        if q.dtype == torch.float32:
            # aten's FlashAttention kernel takes only fp16/bf16; fp32 (tests) uses the reference.
            return self._reference.forward(q, k, v, k_cache, v_cache, meta, scale, k_scale, v_scale)
        fp8 = fp8_kv(k_cache, k_scale, v_scale)
        if not meta.has_prefix:
            if fp8:
                k, v = round_trip_kv(k, k_scale, q.dtype), round_trip_kv(v, v_scale, q.dtype)
            return flash_varlen(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q,
                                meta.max_seqlen_k, scale)
        if meta.max_seqlen_q > self.PAGED_PREFILL_MAX_Q:  # cached prefix + a big chunk: compute-bound
            return gathered_prefill(q, k_cache, v_cache, meta, scale, k_scale, v_scale)
        return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                                       meta.max_seqlen_q, scale, k_scale, v_scale)

    def _mixed(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale, v_scale):
        """A prefill step whose last rows are one-token decode rows (a mixed step): those attend
        through the paged decode kernel as in a decode step (its KV splits keep the GPU busy with
        one query token a sequence, where the prefill kernel's query tiles would sit mostly idle)."""
        d = meta.num_decode_rows
        p, t = len(meta.query_lens) - d, q.size(0) - d  # prefill rows, and their packed tokens
        out = torch.empty_like(q)
        out[t:] = self._decode(q[t:], k_cache, v_cache, meta.block_tables[p:], meta.context_lens[p:], scale,
                               num_splits=meta.num_splits, k_scale=k_scale, v_scale=v_scale)
        if p:
            out[:t] = self.forward(q[:t], k[:t], v[:t], k_cache, v_cache, prefill_part(meta), scale, k_scale, v_scale)
        return out
