"""Continuous batching: which sequences run in the next step, and how many tokens each."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sequence import Sequence, SequenceStatus

PREEMPTION = None  # filled by nanovllm.wiring: loads core/preemption.py when a decode finds no free block


@dataclass
class ScheduledBatch:
    """One step: `num_new_tokens[i]` tokens of `seqs[i]` from its num_cached_tokens on. The fields
    after `preempted` are what scheduling hooks (core/hooks.py) add."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    is_prefill: bool
    preempted: list[Sequence] = field(default_factory=list)
    # Forked samples (sampling row len(seqs) + j samples row fork_rows[j]'s logits), KV blocks to copy after.
    forks: list[Sequence] = field(default_factory=list)
    fork_rows: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Packed positions whose logits are returned too (prompt logprobs: StepInput's fields).
    prompt_rows: list[int] | None = None
    prompt_targets: list[int] | None = None
    prompt_owners: list[tuple[int, int, int]] | None = None
    # Per sequence, drafts after its newest token (counted in num_new_tokens): 1 + len(drafts[i]) rows.
    drafts: list[list[int]] | None = None
    lay_out: Callable[[ScheduledBatch], object] | None = None  # its StepInput, if not from_batch's (drafts)
    adapter_loads: list | None = None  # (slot, adapter) to load before this step (a LoRA hook's)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def rows(self) -> list[Sequence]:
        """The sequence of each of this step's sampling rows, in row order."""
        seqs = self.seqs
        if self.drafts:
            seqs = [s for s, d in zip(seqs, self.drafts) for _ in range(1 + len(d))]
        return seqs + self.forks if self.forks else seqs


class Scheduler:
    """Admits waiting sequences, chunks long prompts and preempts when the KV cache runs out
    (docs/architecture.md). Features plug in through core/hooks.py: `policy`, `hooks`, and
    `held_rows` (sampling rows the hooks hold for a running sequence, counted against max_num_seqs)."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.policy = None  # StepPolicy, or None: prompt work first, else decode
        self.hooks: list = []  # SchedulingHook
        self.held_rows: dict[Sequence, int] = {}

    def add(self, seq: Sequence) -> None:
        # The engine checks requests up front; this guards against one that would wait forever.
        if self.block_manager.blocks_for(len(seq)) > self.block_manager.num_blocks:
            raise ValueError(f"{seq} needs more KV blocks than the whole cache holds")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        """The next step's work (prompt work first, else decode, unless a policy composes it), with
        what the hooks add to it."""
        if self.policy is not None:
            batch = self.policy.compose(self)
        else:
            seqs, counts = self.prompt_work(self.max_num_batched_tokens, admit=True)
            batch = ScheduledBatch(seqs, counts, is_prefill=True) if seqs else self.decode_batch(*self.decode_rows())
        if batch is not None:
            for hook in self.hooks:
                hook.scheduled(self, batch)
        # A hook may take every row out (speculative decoding: rows wait for their tokens).
        return batch if batch is None or batch.seqs else None

    def prompt_work(self, budget: int, admit: bool) -> tuple[list[Sequence], list[int]]:
        """Prompt chunks within `budget` tokens: first the rest of partly prefilled prompts, then
        (`admit`) waiting sequences in arrival order while the sequence cap and free blocks allow."""
        seqs, counts = [], []
        for seq in self.running:
            if budget == 0:
                break
            if seq.num_uncomputed_tokens > 1:  # a prompt chunked in an earlier step
                seqs.append(seq)
                counts.append(min(seq.num_uncomputed_tokens, budget))
                budget -= counts[-1]
        # (A preempted sequence whose drafts are still being verified waits for its tokens.)
        while admit and self.waiting and budget > 0 and not self.waiting[0].drafts and self._admit(self.waiting[0]):
            seq = self.waiting.popleft()
            seqs.append(seq)
            counts.append(min(seq.num_uncomputed_tokens, budget))
            budget -= counts[-1]
        return seqs, counts

    def _admit(self, seq: Sequence) -> bool:
        """Run `seq` if the sequence cap and free blocks allow it, with what hooks reserve for it."""
        if not all(hook.admit(self, seq) for hook in self.hooks):
            return False
        rows = blocks = 0
        for hook in self.hooks:
            r, b = hook.reserve(seq, self.block_manager.block_size)
            rows, blocks = rows + r, blocks + b
        taken = len(self.running) + sum(self.held_rows.values())
        if taken + 1 + rows > self.max_num_seqs or not self.block_manager.can_allocate(seq, blocks):
            return False
        self.block_manager.allocate(seq, blocks)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if rows:
            self.held_rows[seq] = rows
        return True

    def decode_rows(self) -> tuple[list[Sequence], list[Sequence]]:
        """(decode rows, preempted): one token for each running sequence that has only its newest
        token to compute, up to the sequence cap and the token budget, in queue order."""
        bm = self.block_manager
        cap = min(self.max_num_seqs, self.max_num_batched_tokens)
        scheduled: list[Sequence] = []
        preempted: list[Sequence] = []
        kept: list[Sequence] = []  # what goes back to the front of the queue, in its order
        while self.running and len(scheduled) < cap:
            seq = self.running.popleft()
            if seq.num_uncomputed_tokens > 1 or seq.drafts:
                # A prompt being chunked (mixed steps), or drafts the step in flight verifies.
                kept.append(seq)
                continue
            if len(seq) > len(seq.block_table) * bm.block_size:  # its newest token needs a block
                if not bm.can_append(seq) and not PREEMPTION().make_room(self, seq, preempted):
                    continue  # preempted itself
                bm.append_slot(seq)
            scheduled.append(seq)
            kept.append(seq)
        self.running.extendleft(reversed(kept))
        return scheduled, preempted

    def decode_batch(self, rows: list[Sequence], preempted: list[Sequence]) -> ScheduledBatch | None:
        """A decode step of these rows (None without rows), longest context first: the Triton decode
        kernel starts its programs in row order, so the tail shortens (a stable order, step to step)."""
        if not rows:
            return None
        rows.sort(key=len, reverse=True)
        return ScheduledBatch(rows, [1] * len(rows), is_prefill=False, preempted=preempted)

    def retire(self, seq: Sequence) -> None:
        """Take `seq` out of scheduling for good (finished, finishing, or aborted): out of its queue,
        KV blocks freed. Idempotent."""
        if seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)  # preempted while its last token was still on the device
        elif seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.held_rows.pop(seq, None)
            self.block_manager.free(seq)
        elif seq.status != SequenceStatus.FORK_PENDING:
            return
        seq.status = SequenceStatus.DRAINING

    def advance(self, batch: ScheduledBatch, max_model_len: int) -> None:
        """Account for a launched step before its tokens are known (overlap scheduling): each sequence
        that gets a token holds a placeholder; one reaching its length limit is retired here."""
        block_size = self.block_manager.block_size
        next_row = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            drafts = batch.drafts[i] if batch.drafts else []
            row, next_row = next_row, next_row + 1 + len(drafts)  # the row sampling its next token
            if seq.status != SequenceStatus.RUNNING:
                continue  # stopped by the previous step's token, found after this launch
            seq.num_cached_tokens += n - len(drafts)  # drafted tokens count once verified
            if seq.num_cached_tokens >= (seq.num_committed_blocks + 1) * block_size:
                self.block_manager.commit(seq)  # a block just became full
            if seq.num_cached_tokens < seq.num_tokens:
                continue  # partial prompt chunk: no token yet
            seq.add_pending_token(row)
            seq.drafts = drafts
            if seq.reached_length(max_model_len):
                self.retire(seq)
        for hook in self.hooks:
            hook.launched(self, batch, max_model_len)
