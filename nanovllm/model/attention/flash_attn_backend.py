"""The attention backend of the flash-attn package (nano-vllm's original calls), when it is
importable: varlen prefill (paged through the block table on prefix hits) and paged decode."""

from __future__ import annotations

import importlib

import torch

from nanovllm.kernels.kv_store import store_kvcache
from nanovllm.model.attention.metadata import AttentionMetadata


class FlashAttnBackend:
    """The flash-attn package: varlen prefill (paged via block_table on prefix hits), paged decode.

    Takes no FP8 KV cache (a ValueError): flash-attn is not installed on our GPU, so no such
    path could be tested."""

    name = "flash_attn"
    fp8_cache = False

    def __init__(self, module=None):
        fa = module or importlib.import_module("flash_attn")
        self.varlen = fa.flash_attn_varlen_func
        self.with_kvcache = fa.flash_attn_with_kvcache

    @staticmethod
    def _refuse_fp8(k_cache):
        if k_cache.dtype == torch.float8_e4m3fn:
            raise ValueError("the flash_attn attention backend does not support an FP8 KV cache; "
                             "use attention_backend='triton' (or kv_cache_dtype='auto')")

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        self._refuse_fp8(k_cache)
        store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                k_scale=None, v_scale=None) -> torch.Tensor:
        self._refuse_fp8(k_cache)
        if meta.is_prefill:
            if meta.has_prefix:
                k, v, block_table = k_cache, v_cache, meta.block_tables
            else:
                block_table = None
            return self.varlen(q, k, v, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
                               max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                               softmax_scale=scale, causal=True, block_table=block_table)
        out = self.with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.context_lens,
                                block_table=meta.block_tables, softmax_scale=scale, causal=True)
        return out.squeeze(1)
