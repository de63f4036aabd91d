"""Continuous batching: which sequences run in the next step, and how many tokens each."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """The work of one engine step.

    A prefill step computes `num_new_tokens[i]` tokens of `seqs[i]` starting at its
    `num_cached_tokens` (a chunk of a long prompt, or the rest of a prompt after prefix hits);
    a decode step computes exactly one token for every sequence.
    """

    seqs: list[Sequence]
    num_new_tokens: list[int]
    is_prefill: bool
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    """Admits waiting sequences, chunks long prompts and preempts when the KV cache runs out.

    Policy (nano-vllm's, plus chunking): a step is a prefill step whenever some prompt work is
    pending — first the rest of partly prefilled prompts, then new sequences in arrival order
    while the token budget, the sequence cap and free blocks allow. Otherwise every running
    sequence decodes one token; when one needs a block and none is free, the newest running
    sequence is preempted by recompute (its blocks are freed and it goes back to the front of the
    waiting queue, to be prefilled again with its generated tokens).
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        # Callers check up front that the sequence can ever fit (LLMEngine validates requests);
        # this is the last line of defence against a request that would wait forever.
        if self.block_manager.blocks_for(len(seq)) > self.block_manager.num_blocks:
            raise ValueError(f"{seq} needs more KV blocks than the whole cache holds")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        """The next step's work: pending prompt work first, else one decode token for everyone."""
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.max_num_batched_tokens
        seqs, counts = [], []
        for seq in self.running:
            if budget == 0:
                break
            if seq.num_uncomputed_tokens > 1:  # a prompt chunked in an earlier step
                n = min(seq.num_uncomputed_tokens, budget)
                seqs.append(seq)
                counts.append(n)
                budget -= n
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not bm.can_allocate(seq):
                break
            bm.allocate(seq)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return ScheduledBatch(seqs, counts, is_prefill=True) if seqs else None

    def _schedule_decode(self) -> ScheduledBatch | None:
        bm = self.block_manager
        cap = min(self.max_num_seqs, self.max_num_batched_tokens)
        scheduled: list[Sequence] = []
        preempted: list[Sequence] = []
        capacity = bm.block_size
        while self.running and len(scheduled) < cap:
            seq = self.running.popleft()
            if len(seq) <= len(seq.block_table) * capacity:
                scheduled.append(seq)  # the common case: the newest token fits its last block
                continue
            while not bm.can_append(seq):
                # Recompute the newest sequence rather than this older one: it has done the
                # least work, so giving its blocks back wastes the least.
                victim = self.running.pop() if self.running else seq
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.append_slot(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        if not scheduled:
            return None
        # Rows longest context first: the Triton decode attention kernel starts its programs in
        # row order, and the longest ones starting first shorten the tail (kernels/paged_decode.py;
        # other backends do not care). Stable, and every length grows by one per step, so the
        # order holds from step to step. Outputs of a step come in this order too.
        scheduled.sort(key=len, reverse=True)
        return ScheduledBatch(scheduled, [1] * len(scheduled), is_prefill=False, preempted=preempted)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def retire(self, seq: Sequence) -> None:
        """Take `seq` out of scheduling for good (it finished, finishes once its last token
        arrives, or was aborted): out of its queue, KV blocks freed. Idempotent."""
        if seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)  # preempted while its last token was still on the device
        elif seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        else:
            return
        seq.status = SequenceStatus.DRAINING

    def advance(self, batch: ScheduledBatch, max_model_len: int) -> None:
        """Account for a launched step before its tokens are known (overlap scheduling).

        Every sequence that will get a token from this step gets a placeholder for it
        (Sequence.add_pending_token), so the next step can be scheduled with the right lengths
        while this one still runs. A sequence that reaches max_tokens or max_model_len with this
        token is retired here, so it is not scheduled again; its finish reason is decided when
        the token arrives (engine/lifecycle.py).
        """
        block_size = self.block_manager.block_size
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.status != SequenceStatus.RUNNING:
                continue  # stopped by the previous step's token, discovered after this launch
            seq.num_cached_tokens += n
            # Every token before num_cached_tokens is known here: only the last can be pending.
            if seq.num_cached_tokens >= (seq.num_committed_blocks + 1) * block_size:
                self.block_manager.commit(seq)  # a block just became full (skipped on most decode steps)
            if seq.num_cached_tokens < seq.num_tokens:
                continue  # partial prompt chunk: no token yet
            seq.add_pending_token(i)
            if seq.reached_length(max_model_len):
                self.retire(seq)
