"""A scheduled batch as the model's input tensors: `StepInputs` packs a prefill step as freshly built
varlen tensors, a decode step into `DecodeBuffers`, the fixed tensors the CUDA graphs were captured on."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from nanovllm.core.scheduler import ScheduledBatch
from nanovllm.model.attention import AttentionMetadata, host_to_device, prefill_metadata

if TYPE_CHECKING:
    from nanovllm.core.hooks import ShardSampling


@dataclass
class StepInput:
    """What every tensor-parallel rank needs to run one step: plain lists, cheap to pickle.
    token_ids[i]: the new tokens of sequence i (decode: its last token); start_pos[i]: how many of
    them are cached already; block_tables[i]: its KV blocks; src_rows (None when all tokens are
    known): per sequence, the row of the previous step's sampled tokens holding its last new token,
    or -1 (only a decode row has one). The rarer extras, None when unused, are ScheduledBatch's."""

    is_prefill: bool
    token_ids: list[list[int]]
    start_pos: list[int]
    block_tables: list[list[int]]
    src_rows: list[int] | None = None
    sampling: "ShardSampling | None" = None  # sample on every rank (core/hooks.py)
    sync_prev: bool = True  # src_rows' tokens are on rank 0 only: broadcast them first
    fork_rows: list[int] | None = None
    block_copies: list[tuple[int, int]] | None = None
    prompt_rows: list[int] | None = None
    prompt_targets: list[int] | None = None
    prompt_owners: list[tuple[int, int, int]] | None = None
    sample_offsets: list[int] | None = None  # each sampling row's noise offset, when rows verify drafts
    adapters: list[int] | None = None  # each entry's adapter slot (-1: none); None: no adapters
    adapter_loads: list | None = None  # adapters to place in slots before the forward (each rank)

    @classmethod
    def from_batch(cls, batch: ScheduledBatch) -> "StepInput":
        seqs = batch.seqs
        if batch.lay_out is not None:
            return batch.lay_out(batch)
        if batch.is_prefill:
            tokens = [s.token_ids[s.num_cached_tokens:s.num_cached_tokens + n]
                      for s, n in zip(seqs, batch.num_new_tokens)]
        else:
            tokens = [[s.token_ids[-1]] for s in seqs]
        src = [s.pending_row for s in seqs] if any(s.has_pending_token for s in seqs) else None
        step = cls(batch.is_prefill, tokens, [s.num_cached_tokens for s in seqs], [s.block_table for s in seqs], src)
        if batch.forks:
            step.fork_rows, step.block_copies = list(batch.fork_rows), list(batch.block_copies)
        if batch.prompt_rows:
            step.prompt_rows, step.prompt_targets, step.prompt_owners = \
                batch.prompt_rows, batch.prompt_targets, batch.prompt_owners
        return step.with_adapters(batch, [s.adapter_slot for s in seqs])

    def with_adapters(self, batch: ScheduledBatch, slots: list[int]) -> "StepInput":
        """Each entry's adapter slot, and the adapters to load first (ScheduledBatch.adapter_loads)."""
        if batch.adapter_loads or any(s >= 0 for s in slots):
            self.adapters, self.adapter_loads = slots, batch.adapter_loads
        return self


class DecodeBuffers:
    """All decode inputs of up to `max_bs` sequences in one flat int32 buffer, pinned on the host
    and mirrored on the device: a decode step costs one small host-to-device copy. Layout: token
    ids | positions | slot mapping | context lens | source rows (TokenSampler.input_tokens) | block
    tables [max_bs, width]; each field's first `bs` rows are contiguous, so CUDA graphs captured on
    `views(bs)` read the current step's inputs in place."""

    NUM_ROW_FIELDS = 5

    def __init__(self, max_bs: int, width: int, block_size: int, device, pin: bool):
        self.max_bs, self.width, self.block_size = max_bs, width, block_size
        size = max_bs * (self.NUM_ROW_FIELDS + width)
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=pin)
        self.device = torch.zeros(size, dtype=torch.int32, device=device)
        self._host_fields = self._split(self.host.numpy())
        self._device_fields = self._split(self.device)
        self._small = self.NUM_ROW_FIELDS * max_bs  # the per-sequence fields, copied whole (a few KiB)
        self._copied = torch.cuda.Event() if pin else None

    def _split(self, flat):
        m, k = self.max_bs, self.NUM_ROW_FIELDS
        return tuple(flat[i * m:(i + 1) * m] for i in range(k)) + (flat[k * m:].reshape(m, self.width),)

    def views(self, bs: int):
        """(ids, positions, slots, context_lens, src_rows, block_tables) device views for `bs` rows."""
        return tuple(f[:bs] for f in self._device_fields)

    def load(self, step: StepInput, bs: int):
        """Fill the first `bs` rows from `step` (rows past its sequences are padding: slot -1,
        context 0) and copy them to the device; returns `views(bs)`."""
        n = len(step.token_ids)
        if bs > self.max_bs or n > bs:
            raise ValueError(f"decode batch of {n} (padded {bs}) exceeds the buffers' {self.max_bs} rows")
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy must be done before we overwrite
        ids, pos, slots, ctx, src, tables = self._host_fields
        ids[:n] = [t[0] for t in step.token_ids]
        pos[:n] = step.start_pos
        src[:n] = -1 if step.src_rows is None else step.src_rows
        # Block tables as one fancy-indexed write instead of a Python loop over rows.
        lens = np.fromiter(map(len, step.block_tables), dtype=np.int64, count=n)
        flat = np.fromiter(itertools.chain.from_iterable(step.block_tables), dtype=np.int32, count=int(lens.sum()))
        rows = np.repeat(np.arange(n), lens)
        cols = np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)
        tables[:bs] = -1
        tables[rows, cols] = flat
        p = pos[:n]
        slots[:n] = tables[np.arange(n), p // self.block_size] * self.block_size + p % self.block_size
        ctx[:n] = p + 1
        for field, pad in ((ids, 0), (pos, 0), (slots, -1), (ctx, 0), (src, -1)):
            field[n:bs] = pad
        # One copy: the small fields and only the block-table rows in use, which follow them (the
        # full table can be megabytes with small blocks and a long max_model_len).
        end = self._small + bs * self.width
        self.device[:end].copy_(self.host[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return self.views(bs)


class StepInputs:
    """Packs `StepInput`s into the model's input tensors on one rank's device."""

    def __init__(self, max_rows: int, max_blocks_per_seq: int, block_size: int, device: torch.device,
                 backend_name: str, num_kv_heads: int):
        self.block_size, self.device = block_size, device
        self.pin = device.type == "cuda"
        self.backend_name, self.num_kv_heads = backend_name, num_kv_heads
        self.buffers = DecodeBuffers(max_rows, max_blocks_per_seq, block_size, device, self.pin)
        self._splits: dict[tuple[int, int], int] = {}

    def _to_device(self, data, dtype) -> torch.Tensor:
        # Through pinned memory: from pageable memory the copy waits for the GPU to drain its queue.
        return host_to_device(data, dtype, self.device, self.pin)

    def prefill(self, step: StepInput, input_tokens=None):
        """Packed prefill inputs: token ids, positions, metadata, and each sequence's last row. A mixed
        step's decode rows (`step.src_rows`) take their tokens from the device: `input_tokens`."""
        bs = self.block_size
        q_lens = np.fromiter(map(len, step.token_ids), dtype=np.int64, count=len(step.token_ids))
        starts = np.asarray(step.start_pos, dtype=np.int64)
        k_lens = starts + q_lens
        cu_q = np.cumsum(q_lens)
        # Position of every packed token, and the block-table row it belongs to, without a
        # Python loop over tokens (a prefill step can hold 16k of them).
        seq_idx = np.repeat(np.arange(len(q_lens)), q_lens)
        positions = np.arange(int(cu_q[-1])) - np.repeat(cu_q - q_lens - starts, q_lens)
        width = max(map(len, step.block_tables))
        tables = np.full((len(q_lens), width), -1, dtype=np.int64)
        for i, row in enumerate(step.block_tables):
            tables[i, :len(row)] = row
        slots = tables[seq_idx, positions // bs] * bs + positions % bs
        q_list, k_list = q_lens.tolist(), k_lens.tolist()
        has_prefix = k_list != q_list
        table_tensor = self._to_device(tables, torch.int32) if has_prefix else None
        slot_mapping = self._to_device(slots, torch.int32)
        meta = prefill_metadata(q_list, k_list, slot_mapping, table_tensor, self.device, self.pin)
        if has_prefix and self.backend_name == "triton":
            # The decode rows of a mixed step come last: the paged decode kernel takes them.
            ones = np.flatnonzero(q_lens != 1)
            meta.num_decode_rows = len(q_list) - (int(ones[-1]) + 1 if ones.size else 0)
            if meta.num_decode_rows:
                meta.num_splits = self.num_splits(meta.num_decode_rows, width)
        ids = self._to_device(list(itertools.chain.from_iterable(step.token_ids)), torch.long)
        if step.src_rows is not None:
            # The pending token of a row is its last new token (and its only one).
            src = np.full(int(cu_q[-1]), -1, dtype=np.int64)
            src[cu_q - 1] = step.src_rows
            ids = input_tokens(ids, self._to_device(src, torch.long))
        return ids, self._to_device(positions, torch.long), meta, self._to_device(cu_q - 1, torch.long)

    def decode(self, step: StepInput, padded_bs: int, input_tokens):
        """Decode inputs padded to `padded_bs` rows (a captured graph's batch size), as views of the
        decode buffers."""
        ids, pos, slots, ctx, src, tables = self.buffers.load(step, padded_bs)
        kv_lens = None
        if self.backend_name == "torch":  # it loops over sequences on the host
            kv_lens = [p + 1 for p in step.start_pos] + [0] * (padded_bs - len(step.start_pos))
        meta = self.decode_metadata(padded_bs, slots, ctx, tables, kv_lens)
        return input_tokens(ids, src), pos, meta

    def decode_metadata(self, bs: int, slots, ctx, tables, kv_lens: list[int] | None = None) -> AttentionMetadata:
        return AttentionMetadata(
            is_prefill=False, slot_mapping=slots, context_lens=ctx, block_tables=tables,
            query_lens=kv_lens and [min(k, 1) for k in kv_lens], kv_lens=kv_lens,
            num_splits=self.num_splits(bs, tables.size(1)))

    def num_splits(self, batch_size: int, width: int) -> int:
        """KV splits of the Triton decode kernel for this batch shape (fixed per captured graph)."""
        if self.backend_name != "triton":
            return 1
        key = (batch_size, width)
        if key not in self._splits:
            from nanovllm.kernels.paged_decode import choose_num_splits

            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self._splits[key] = choose_num_splits(batch_size, self.num_kv_heads, width, num_sms=sms)
        return self._splits[key]
