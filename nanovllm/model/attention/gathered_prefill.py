"""Prefill attention over cached tokens by gathering: each context read back from the paged cache
into contiguous varlen K/V (an FP8 cache dequantized on the way), then aten's FlashAttention-2.

The Triton backend reads the cache in place with kernels/paged_prefill.py for most prefills with
cached tokens; it takes this path for big query chunks (a long prompt's later chunks), where
attention is compute-bound and FlashAttention-2's tiles beat the paged kernel's (H100, 8,192 new
tokens after 8,192 cached: bf16 4.85 against 5.22 ms, FP8 5.11 against 6.57; BENCHMARKS.md
"Prefills with cached tokens")."""

from __future__ import annotations

import itertools

import torch

from nanovllm.model.attention.fp8_cache import dequantize_kv
from nanovllm.model.attention.metadata import AttentionMetadata

# K/V tokens gathered per group: 256 MiB of K+V at 8 heads x 128 in bf16. Prefix hits make
# contexts much longer than the step's token budget, so the copy is bounded group by group.
GATHER_TOKENS = 1 << 16


def flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """aten's bundled FlashAttention-2 over varlen q / K / V, causal (bottom-right aligned)."""
    return torch.ops.aten._flash_attention_forward(q, k, v.contiguous(), cu_q, cu_k, max_q, max_k, 0.0, True,
                                                  False, scale=scale)[0]


def gather_kv_varlen(cache: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     total: int) -> torch.Tensor:
    """The cached K (or V) of several sequences packed varlen as `cu_seqlens_k` describes.

    Vectorised (no per-sequence loop): token t of sequence i is slot
    block_tables[i, t // block_size] * block_size + t % block_size.
    """
    block_size = cache.size(1)
    kv_lens = cu_seqlens_k.diff().long()
    seq_idx = torch.repeat_interleave(torch.arange(kv_lens.numel(), device=cache.device), kv_lens,
                                      output_size=total)
    pos = torch.arange(total, device=cache.device) - cu_seqlens_k[seq_idx]
    blocks = block_tables[seq_idx, pos // block_size].long()
    return cache.view(-1, *cache.shape[2:])[blocks * block_size + pos % block_size]


def groups_of_at_most(lengths: list[int], limit: int):
    """Consecutive index ranges [a, b) whose lengths sum to <= limit (a single longer one alone)."""
    a, total = 0, 0
    for i, n in enumerate(lengths):
        if total and total + n > limit:
            yield a, i
            a, total = i, 0
        total += n
    if a < len(lengths):
        yield a, len(lengths)


def gathered_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, k_scale=None, v_scale=None) -> torch.Tensor:
    """Attention of the step's new tokens over their whole contexts (the new K/V already stored
    in the cache), GATHER_TOKENS of context at a time."""
    out = torch.empty_like(q)
    cu_q_host = [0, *itertools.accumulate(meta.query_lens)]
    for a, b in groups_of_at_most(meta.kv_lens, GATHER_TOKENS):
        cu_q = meta.cu_seqlens_q[a:b + 1] - meta.cu_seqlens_q[a]
        cu_k = meta.cu_seqlens_k[a:b + 1] - meta.cu_seqlens_k[a]
        total = sum(meta.kv_lens[a:b])
        kk = dequantize_kv(gather_kv_varlen(k_cache, meta.block_tables[a:b], cu_k, total), k_scale, q.dtype)
        vv = dequantize_kv(gather_kv_varlen(v_cache, meta.block_tables[a:b], cu_k, total), v_scale, q.dtype)
        rows = slice(cu_q_host[a], cu_q_host[b])
        out[rows] = flash_varlen(q[rows], kk, vv, cu_q, cu_k, max(meta.query_lens[a:b]), max(meta.kv_lens[a:b]),
                                 scale)
    return out
