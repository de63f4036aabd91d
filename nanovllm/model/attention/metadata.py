"""Per-step attention metadata, built by the core (step_inputs.py) and passed down through the model."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where each token's K/V go and which cached K/V each sequence attends to; the tokens of all
    sequences are packed along one dimension (varlen layout)."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # [num_tokens]: cache slot (block * block_size + offset) per token, -1: skip
    context_lens: torch.Tensor  # [num_seqs] int32: K/V length of each sequence after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32: physical block ids, padded with -1
    # Prefill only: prefix sums [num_seqs + 1] int32 of new-token and K/V lengths, their maxima, and
    # whether some sequence has cached tokens (then K/V are read from the paged cache).
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    has_prefix: bool = False
    query_lens: list[int] | None = None  # the same lengths as host lists (backends looping on the host)
    kv_lens: list[int] | None = None
    num_splits: int = 1  # KV splits of the Triton decode kernel (fixed per captured batch size)
    # Prefill, triton backend: the last this many sequences are a mixed step's decode rows (one new
    # token, cached K/V), which attend through the paged decode kernel with num_splits splits.
    num_decode_rows: int = 0


def host_to_device(data, dtype: torch.dtype, device, pin_memory: bool = False) -> torch.Tensor:
    """A host list or numpy array as a device tensor (from pinned memory: without blocking the host)."""
    t = torch.as_tensor(data, dtype=dtype)
    if pin_memory:  # (torch.tensor(..., pin_memory=True) refuses numpy arrays)
        t = t.pin_memory()
    return t.to(device, non_blocking=pin_memory)


def prefill_metadata(query_lens: list[int], kv_lens: list[int], slot_mapping: torch.Tensor,
                     block_tables: torch.Tensor | None, device, pin_memory: bool = False) -> AttentionMetadata:
    """Metadata of a prefill step from per-sequence new-token and K/V lengths (host lists);
    `block_tables` may be None when no sequence has cached tokens."""
    def to_dev(data):
        return host_to_device(data, torch.int32, device, pin_memory)

    cu_q = [0, *itertools.accumulate(query_lens)]
    cu_k = [0, *itertools.accumulate(kv_lens)]
    if block_tables is None:
        block_tables = torch.empty(len(query_lens), 0, dtype=torch.int32, device=device)
    return AttentionMetadata(
        is_prefill=True, slot_mapping=slot_mapping.to(device, non_blocking=True), context_lens=to_dev(kv_lens),
        block_tables=block_tables, cu_seqlens_q=to_dev(cu_q), cu_seqlens_k=to_dev(cu_k),
        max_seqlen_q=max(query_lens), max_seqlen_k=max(kv_lens),
        has_prefix=list(kv_lens) != list(query_lens),
        query_lens=list(query_lens), kv_lens=list(kv_lens))
