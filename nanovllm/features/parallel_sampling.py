"""Parallel sampling (`SamplingParams.n > 1`): the prompt is prefilled once, and n samples run on
its KV blocks. A SchedulingHook (core/hooks.py), registered by the first request with n > 1.

A request with n > 1 is queued as its sample 0; the others wait (FORK_PENDING) in its
`pending_forks`. From the admission of sample 0 on, their rows count against max_num_seqs and,
when the prompt's last block is partly filled, a free block is held for each, so a fork never
waits for one. The step that computes the prompt's last token (a prefill chunk, or a decode row
when a chunk left one token) forks them: each shares the prompt's full blocks by ref count, gets
its own copy of the partly filled last block (copy on write, after the step's forward), and
samples its first token from the logits of sample 0's row. From then on each sample is a
sequence of its own: it decodes, is preempted and recomputed, and finishes on its own.
"""

from __future__ import annotations

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.hooks import SchedulingHook
from nanovllm.core.scheduler import ScheduledBatch, Scheduler
from nanovllm.core.sequence import Sequence, SequenceStatus


class ParallelSampling(SchedulingHook):
    """Makes the samples of n > 1 requests and forks them from sample 0 (see the module doc)."""

    def added(self, seq: Sequence, new_sample) -> None:
        if seq.params.n == 1:
            return
        samples = [seq] + [new_sample(i) for i in range(1, seq.params.n)]
        for child in samples[1:]:
            child.request_id, child.prompt_text = seq.request_id, seq.prompt_text
            child.prompt_logprobs = None  # the request's prompt logprobs are sample 0's
            child.samples = samples
        seq.samples, seq.pending_forks = samples, samples[1:]

    def reserve(self, seq: Sequence, block_size: int) -> tuple[int, int]:
        """A row for each sample to fork, and a block for each one not aborted meanwhile that
        needs its own copy of the prompt's partly filled last block."""
        if not seq.pending_forks:
            return 0, 0
        copies = 0 if len(seq) % block_size == 0 else sum(1 for s in seq.pending_forks if not s.is_finished)
        return len(seq.pending_forks), copies

    def scheduled(self, scheduler: Scheduler, batch: ScheduledBatch) -> None:
        """Fork the pending samples of every row that computes the last token of its prompt."""
        if scheduler.held_rows:
            for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
                if seq.pending_forks and n == seq.num_uncomputed_tokens:
                    self._fork(scheduler, batch, seq, row)

    def _fork(self, scheduler: Scheduler, batch: ScheduledBatch, parent: Sequence, row: int) -> None:
        scheduler.held_rows.pop(parent, None)
        children, parent.pending_forks = parent.pending_forks, []
        for child in children:
            if child.is_finished:  # aborted with its request before the fork
                continue
            self._share_prompt(scheduler.block_manager, batch, parent, child)
            child.status = SequenceStatus.RUNNING
            scheduler.running.append(child)
            batch.forks.append(child)
            batch.fork_rows.append(row)
        scheduler.block_manager.release_reserved(parent)

    @staticmethod
    def _share_prompt(bm: BlockManager, batch: ScheduledBatch, parent: Sequence, child: Sequence) -> None:
        """The full blocks of the prompt are shared; a partly filled last block would be written
        by both, so the child gets one of the blocks reserved for it and the step copies the
        parent's into it once the forward has filled it (copy on write)."""
        full = len(parent) // bm.block_size
        child.block_table = parent.block_table[:full]
        for block_id in child.block_table:  # one more holder of the same computed K/V
            bm.blocks[block_id].ref_count += 1
        bm.num_shared_refs += len(child.block_table)
        if len(parent.block_table) > full:
            if not parent.reserved_blocks:
                raise RuntimeError(f"internal error: no block reserved for a fork of {parent}")
            child.block_table.append(parent.reserved_blocks.pop())
            batch.block_copies.append((parent.block_table[full], child.block_table[-1]))

    def launched(self, scheduler: Scheduler, batch: ScheduledBatch, max_model_len: int) -> None:
        """The samples forked in this step hold the prompt, computed, and a pending first token
        (sampling row len(seqs) + j)."""
        block_size = scheduler.block_manager.block_size
        for j, (child, row) in enumerate(zip(batch.forks, batch.fork_rows)):
            if child.status != SequenceStatus.RUNNING:
                continue
            parent = batch.seqs[row]
            # The prompt's full blocks are the parent's, committed by advance: same count and hashes.
            child.num_cached_tokens = child.num_tokens
            child.num_committed_blocks = min(parent.num_committed_blocks, child.num_tokens // block_size)
            child.block_hashes = parent.block_hashes[:child.num_committed_blocks]
            child.add_pending_token(len(batch.seqs) + j)
            if child.reached_length(max_model_len):
                scheduler.retire(child)
