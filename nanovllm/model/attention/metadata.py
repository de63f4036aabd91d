"""Per-step attention metadata, built by the core (step_inputs.py) and passed down through the model."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where each token's K/V go and which cached K/V each sequence attends to.

    Tokens of all sequences are packed along one dimension (varlen layout).
    slot_mapping [num_tokens]: cache slot (block_id * block_size + offset) for each token's
        K/V, -1 to skip (CUDA-graph padding).
    context_lens [num_seqs] int32: K/V length of each sequence after this step (cached + new).
    block_tables [num_seqs, max_blocks] int32: physical block ids, padded with -1.
    Prefill only: cu_seqlens_q / cu_seqlens_k [num_seqs + 1] int32 prefix sums of the new-token
        and K/V lengths, their maxima, and `has_prefix` when some sequence already has cached
        tokens (prefix hit or an earlier chunk), so K/V must be read from the paged cache.
    query_lens / kv_lens: the same lengths as host lists, for backends that loop on the host.
    num_splits: how many KV splits the Triton decode kernel uses (fixed per captured batch size).
    num_decode_rows (prefill only; set for the triton backend): the last this many sequences
        have one new token each and cached K/V (the decode rows of a mixed step); they attend
        through the paged decode kernel, with num_splits splits.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    has_prefix: bool = False
    query_lens: list[int] | None = None
    kv_lens: list[int] | None = None
    num_splits: int = 1
    num_decode_rows: int = 0


def host_to_device(data, dtype: torch.dtype, device, pin_memory: bool = False) -> torch.Tensor:
    """A host list or numpy array as a device tensor; from pinned memory the copy does not block
    the host."""
    t = torch.as_tensor(data, dtype=dtype)
    if pin_memory:  # (torch.tensor(..., pin_memory=True) refuses numpy arrays)
        t = t.pin_memory()
    return t.to(device, non_blocking=pin_memory)


def prefill_metadata(query_lens: list[int], kv_lens: list[int], slot_mapping: torch.Tensor,
                     block_tables: torch.Tensor | None, device, pin_memory: bool = False) -> AttentionMetadata:
    """Metadata of a prefill step from per-sequence new-token and K/V lengths (host lists).

    `block_tables` may be None when no sequence has cached tokens and the backend reads K/V
    straight from this step's projections.
    """
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
