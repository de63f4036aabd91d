"""The paged KV cache of one rank: how many blocks fit, and the tensor that holds them.

Layout: one tensor [2 (K, V), layers, blocks, block_size, kv_heads, head_dim]; each attention
layer gets views of its K and V caches (flash-attn's paged layout per layer).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from nanovllm.model.attention import host_to_device, prefill_metadata

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # automatic KV-cache size on CPU


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one rank's KV cache, per block."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, attn_layers, device: torch.device) -> torch.Tensor:
    """The cache tensor for `num_blocks` blocks; binds each layer's k_cache / v_cache views."""
    if num_blocks < 1:
        raise RuntimeError("no GPU memory left for the KV cache: lower max_num_batched_tokens or "
                           "raise gpu_memory_utilization")
    cache = torch.empty(2, spec.num_layers, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim,
                        dtype=spec.dtype, device=device)
    for i, layer in enumerate(attn_layers):
        layer.k_cache = cache[0, i]
        layer.v_cache = cache[1, i]
    logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s, %d bytes per token)", num_blocks,
                spec.block_size, num_blocks * spec.block_size, num_blocks * spec.bytes_per_block / 2**30,
                str(spec.dtype).removeprefix("torch."), spec.bytes_per_block // spec.block_size)
    return cache


def copy_blocks(cache: torch.Tensor, copies: list[tuple[int, int]], device: torch.device) -> None:
    """KV blocks src -> dst in every layer of `cache` (copy on write of a prompt's last block for
    the samples forked from it)."""
    pin = device.type == "cuda"
    src = host_to_device([a for a, _ in copies], torch.long, device, pin)
    dst = host_to_device([b for _, b in copies], torch.long, device, pin)
    cache[:, :, dst] = cache.index_select(2, src)


def blocks_that_fit(config, spec: KVCacheSpec, model, device: torch.device, max_blocks_per_seq: int,
                    sampling_rank: bool, other_bytes: int = 0, graph_tokens: int = 0) -> int:
    """KV blocks for this rank: `config.num_kvcache_blocks` when given, a fixed budget on CPU,
    else what the GPU budget leaves (blocks_from_gpu_budget; `graph_tokens`: the largest
    prefill step the forward strategy replays as graphs, 0 for none)."""
    if config.num_kvcache_blocks > 0:
        return config.num_kvcache_blocks
    # A draft model (speculative decoding) keeps its K/V in the same blocks: charge both.
    draft = config.speculation
    per_block = spec.bytes_per_block + (draft.kv_bytes_per_block(spec.block_size, config.dtype) if draft else 0)
    if device.type == "cpu":
        return max(CPU_KV_CACHE_BYTES // per_block, max_blocks_per_seq)
    # The draft's weights, graphs and catch-up activations come after the model's cache: reserved
    # as 25% over its weights, out of the budget and of the free memory.
    later = int(1.25 * draft.weight_bytes(config.dtype)) if draft else 0
    return blocks_from_gpu_budget(config, spec, model, device, sampling_rank, other_bytes, graph_tokens, per_block,
                                  later)


def blocks_from_gpu_budget(config, spec: KVCacheSpec, model, device: torch.device, sampling_rank: bool,
                           other_bytes: int = 0, graph_tokens: int = 0, per_block: int = 0,
                           later_bytes: int = 0) -> int:
    """KV blocks that fit in gpu_memory_utilization of the GPU, counting only our own use.

    Our use = weights + the activation peak of a warm-up prefill at max_num_batched_tokens
    + what the CUDA-graph pool holds: the larger of the largest decode batch's forward and
    (with piecewise prefill graphs) the largest prefill bucket's, plus the latter's buffers;
    + the largest decode batch's logits and room for sampling with a full-vocabulary sort (top-p, the worst case; on the
    sampling rank only) + `other_bytes` held outside the caching allocator (symmetric memory).
    Other processes' memory is not charged to us, but we never take more than is free.
    """
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    warmup_forward(model, min(config.max_num_batched_tokens, config.max_num_seqs * config.max_model_len),
                   config.max_model_len, device)
    prefill_peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    warmup_forward(model, config.max_num_seqs, 1, device)
    graph_peak = torch.cuda.max_memory_allocated() - base
    if graph_tokens:  # the pieces share the decode graphs' pool (features/prefill_graphs.py)
        torch.cuda.reset_peak_memory_stats()
        warmup_forward(model, graph_tokens, config.max_model_len, device)
        # Its q/k/v, attention-output and hidden-state buffers: under 8 x hidden_size per token.
        buffers = graph_tokens * config.hf_config.hidden_size * 8 * config.dtype.itemsize
        graph_peak = max(graph_peak, torch.cuda.max_memory_allocated() - base) + buffers
    # Sampling is not run here (that would compile its kernels inside the cold start): its
    # worst case, a full-vocabulary sort for top-p, holds about fp32 logits + sorted values +
    # int64 indices + a cumulative sum per row, ~24 bytes per logit.
    sampler_peak = config.max_num_seqs * config.hf_config.vocab_size * 24 if sampling_rank else 0
    decode_peak = graph_peak + sampler_peak
    logger.info("KV budget charges %.0f MiB for prefill, %.0f MiB for the CUDA graphs, %.0f MiB for sampling",
                prefill_peak / 2**20, graph_peak / 2**20, sampler_peak / 2**20)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    held = base + other_bytes
    budget = total * config.gpu_memory_utilization - held - prefill_peak - decode_peak - later_bytes
    headroom = free - prefill_peak - decode_peak - later_bytes - (256 << 20)
    return int(min(budget, headroom) // (per_block or spec.bytes_per_block))


@torch.inference_mode()
def warmup_forward(model, num_tokens: int, seq_len: int, device: torch.device) -> None:
    """One eager forward over `num_tokens` tokens in sequences of `seq_len`, without a KV
    cache, plus logits of each sequence's last token, to measure memory."""
    num_tokens = max(1, num_tokens)
    seq_len = min(num_tokens, seq_len)
    lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    pos = torch.cat([torch.arange(n, device=device) for n in lens])
    meta = prefill_metadata(lens, lens, torch.full((num_tokens,), -1, dtype=torch.int32), None, device)
    hidden = model(ids, pos, meta)
    last = torch.tensor(lens, device=device).cumsum(0) - 1
    model.compute_logits(hidden[last])
