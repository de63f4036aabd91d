"""Continuous batching: which sequences run in the next step, and how many tokens each."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus


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

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence now (stop condition met, or aborted) and free its blocks."""
        if seq.is_finished:
            return
        if seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)  # preempted while its last token was still on the device
        else:
            self.running.remove(seq)
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def advance(self, batch: ScheduledBatch, max_model_len: int) -> None:
        """Account for a launched step before its tokens are known (overlap scheduling).

        Every sequence that will get a token from this step gets a PENDING_TOKEN placeholder, so
        the next step can be scheduled with the right lengths while this one still runs; its
        value arrives with `resolve`. Stops that do not depend on the token's value (max_tokens,
        max_model_len) end the sequence here, so it is not scheduled again.
        """
        bm = self.block_manager
        block_size = bm.block_size
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.is_finished:
                continue  # stopped by the previous step's token, discovered after this launch
            seq.num_cached_tokens += n
            # Every token before num_cached_tokens is known here: only the last can be pending.
            if seq.num_cached_tokens >= (seq.num_committed_blocks + 1) * block_size:
                bm.commit(seq)  # a block just became full (skipped on most decode steps)
            if seq.num_cached_tokens < seq.num_tokens:
                continue  # partial prompt chunk: no token yet
            seq.token_ids.append(PENDING_TOKEN)
            seq.pending_row = i
            p = seq.params
            if seq.num_completion_tokens >= p.max_tokens or seq.num_tokens >= max_model_len:
                self.finish(seq, "length")

    def resolve(self, batch: ScheduledBatch, token_ids: list[int], eos_token_ids: frozenset[int]) -> list[Sequence]:
        """Fill in the tokens of an advanced step (`token_ids[i]` was sampled for `batch.seqs[i]`)
        and apply the token-value stops. Returns the sequences that got a token."""
        advanced = []
        for i, (seq, token_id) in enumerate(zip(batch.seqs, token_ids)):
            if seq.pending_row != i:
                continue  # partial prompt chunk, or aborted
            seq.token_ids[-1] = token_id
            seq.pending_row = -1
            advanced.append(seq)
            if is_stop_token(seq, token_id, eos_token_ids):
                if seq.is_finished:
                    seq.finish_reason = "stop"  # both rules fired; the token's decides, as in vLLM
                else:
                    self.finish(seq, "stop")
        return advanced

    def postprocess(self, batch: ScheduledBatch, token_ids: list[int], eos_token_ids: frozenset[int],
                    max_model_len: int) -> list[Sequence]:
        """`advance` and `resolve` at once, for a step whose tokens are already known."""
        self.advance(batch, max_model_len)
        return self.resolve(batch, token_ids, eos_token_ids)


def is_stop_token(seq: Sequence, token_id: int, eos_token_ids: frozenset[int]) -> bool:
    """Whether `token_id`, just appended to `seq`, ends it (stop ids / EOS after min_tokens)."""
    p = seq.params
    if seq.num_completion_tokens < p.min_tokens:
        return False
    return token_id in p.stop_ids or (not p.ignore_eos and token_id in eos_token_ids)
