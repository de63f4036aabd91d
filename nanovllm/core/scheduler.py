"""Continuous batching: which sequences run in the next step, and how many tokens each."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """The work of one engine step.

    A prefill step computes `num_new_tokens[i]` tokens of `seqs[i]` starting at its
    `num_cached_tokens` (a chunk of a long prompt, or the rest of a prompt after prefix hits);
    a decode step computes exactly one token for every sequence.

    Samples of an n > 1 request forked in this step (`forks`) compute nothing: each samples its
    first token from the logits of its parent, row `fork_rows[j]` of `seqs`; their tokens follow
    the others' (sampling row len(seqs) + j, see `rows`). `block_copies` are the (src, dst) KV
    blocks to copy once this step has run (each fork's own copy of the prompt's last block).
    """

    seqs: list[Sequence]
    num_new_tokens: list[int]
    is_prefill: bool
    preempted: list[Sequence] = field(default_factory=list)
    forks: list[Sequence] = field(default_factory=list)
    fork_rows: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def rows(self) -> list[Sequence]:
        """The sequences that get a token from this step's sampling rows, in row order."""
        return self.seqs + self.forks if self.forks else self.seqs


class Scheduler:
    """Admits waiting sequences, chunks long prompts and preempts when the KV cache runs out.

    Policy (nano-vllm's, plus chunking): a step is a prefill step whenever some prompt work is
    pending — first the rest of partly prefilled prompts, then new sequences in arrival order
    while the token budget, the sequence cap and free blocks allow. Otherwise every running
    sequence decodes one token; when one needs a block and none is free, the newest running
    sequence is preempted by recompute (its blocks are freed and it goes back to the front of the
    waiting queue, to be prefilled again with its generated tokens).

    A request with n > 1 is queued as its sample 0; the step that computes the last token of its
    prompt forks the other samples (BlockManager.fork), which then run as sequences of their
    own. Their rows are counted against max_num_seqs from the admission of sample 0 on.

    `mixed_steps` (the server's policy, for latency): decoding sequences never wait for prompt
    work. Every step first gives each decoding sequence its one token (preempting as a decode
    step does), then spends what is left of the token budget on prompt chunks and admissions;
    such a step is prefill-shaped (is_prefill, varlen) with one-token rows for the decoders.
    A step with no prompt work is a plain decode step (CUDA graphs). No sequence is admitted in
    a step that preempted one: the cache is short, and a sequence preempted just now may still
    wait for its newest token.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 mixed_steps: bool = False):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.mixed_steps = mixed_steps
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self._forking: set[Sequence] = set()  # running sequences with samples still to fork

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
        """The next step's work: pending prompt work first, else one decode token for everyone
        (with mixed_steps: decode tokens for everyone, then prompt work in the same step)."""
        if self.mixed_steps:
            return self._schedule_mixed()
        return self._schedule_prefill() or self._schedule_decode()

    def _rows_taken(self) -> int:
        """Sampling rows of the running sequences and of the samples they will fork."""
        unforked = sum(len(s.pending_forks) for s in self._forking) if self._forking else 0
        return len(self.running) + unforked

    def _schedule_prefill(self) -> ScheduledBatch | None:
        seqs, counts = self._prompt_work(self.max_num_batched_tokens, admit=True)
        if not seqs:
            return None
        batch = ScheduledBatch(seqs, counts, is_prefill=True)
        self._fork_finished_prompts(batch)
        return batch

    def _prompt_work(self, budget: int, admit: bool) -> tuple[list[Sequence], list[int]]:
        """Prompt chunks within `budget` tokens: first the rest of partly prefilled prompts, then
        (`admit`) waiting sequences in arrival order while the sequence cap and free blocks allow."""
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
        while admit and self.waiting and budget > 0 and \
                self._rows_taken() + 1 + len(self.waiting[0].pending_forks) <= self.max_num_seqs:
            seq = self.waiting[0]
            if not bm.can_allocate(seq):
                break
            bm.allocate(seq)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.pending_forks:
                self._forking.add(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return seqs, counts

    def _fork_finished_prompts(self, batch: ScheduledBatch) -> None:
        """Fork the pending samples of every row that computes the last token of its prompt
        (a prefill chunk, or a decode row when a chunk left one token)."""
        if self._forking:
            for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
                if seq.pending_forks and n == seq.num_uncomputed_tokens:
                    self._fork(batch, seq, i)

    def _fork(self, batch: ScheduledBatch, parent: Sequence, row: int) -> None:
        """`batch` computes the last prompt token of `parent` (row `row`): fork its pending
        samples, which sample their first tokens from that row's logits."""
        self._forking.discard(parent)
        children, parent.pending_forks = parent.pending_forks, []
        for child in children:
            if child.is_finished:  # aborted with its request before the fork
                continue
            copy = self.block_manager.fork(parent, child)
            if copy is not None:
                batch.block_copies.append(copy)
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
            batch.forks.append(child)
            batch.fork_rows.append(row)
        self.block_manager.release_reserved(parent)

    def _schedule_decode(self) -> ScheduledBatch | None:
        scheduled, preempted = self._decode_rows()
        if not scheduled:
            return None
        return self._decode_batch(scheduled, preempted)

    def _decode_batch(self, scheduled: list[Sequence], preempted: list[Sequence]) -> ScheduledBatch:
        # Rows longest context first: the Triton decode attention kernel starts its programs in
        # row order, and the longest ones starting first shorten the tail (kernels/paged_decode.py;
        # other backends do not care). Stable, and every length grows by one per step, so the
        # order holds from step to step. Outputs of a step come in this order too.
        scheduled.sort(key=len, reverse=True)
        batch = ScheduledBatch(scheduled, [1] * len(scheduled), is_prefill=False, preempted=preempted)
        self._fork_finished_prompts(batch)
        return batch

    def _decode_rows(self) -> tuple[list[Sequence], list[Sequence]]:
        """(decode rows, preempted): one token for each running sequence that has only its
        newest token to compute, up to the sequence cap and the token budget, in queue order;
        a row that needs a block and finds none preempts the newest running sequence (which
        may be itself). Partly prefilled prompts (mixed steps only) are passed over."""
        bm = self.block_manager
        cap = min(self.max_num_seqs, self.max_num_batched_tokens)
        scheduled: list[Sequence] = []
        preempted: list[Sequence] = []
        kept: list[Sequence] = []  # what goes back to the front of the queue, in its order
        capacity, mixed = bm.block_size, self.mixed_steps
        while self.running and len(scheduled) < cap:
            seq = self.running.popleft()
            if mixed and seq.num_uncomputed_tokens > 1:  # (split steps decode only when no prompt is pending)
                kept.append(seq)  # a prompt being chunked (mixed steps): not a decode row
                continue
            if len(seq) <= len(seq.block_table) * capacity:
                scheduled.append(seq)  # the common case: the newest token fits its last block
                kept.append(seq)
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
                kept.append(seq)
        self.running.extendleft(reversed(kept))
        return scheduled, preempted

    def _schedule_mixed(self) -> ScheduledBatch | None:
        """Decode rows first, then prompt work in the rest of the budget (see the class doc)."""
        decoding, preempted = self._decode_rows()
        seqs, counts = self._prompt_work(self.max_num_batched_tokens - len(decoding), admit=not preempted)
        if not seqs:
            return self._decode_batch(decoding, preempted) if decoding else None
        batch = ScheduledBatch(seqs + decoding, counts + [1] * len(decoding), is_prefill=True, preempted=preempted)
        self._fork_finished_prompts(batch)
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self._forking.discard(seq)
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
            self._forking.discard(seq)
            self.block_manager.free(seq)
        elif seq.status != SequenceStatus.FORK_PENDING:
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
            if seq.prompt_logprobs is not None:  # their positions are computed by this step
                seq.num_prompt_logprobs_planned = max(seq.num_prompt_logprobs_planned,
                                                      min(seq.num_cached_tokens, seq.num_prompt_tokens - 1))
            if seq.num_cached_tokens < seq.num_tokens:
                continue  # partial prompt chunk: no token yet
            seq.add_pending_token(i)
            if seq.reached_length(max_model_len):
                self.retire(seq)
        for j, (child, row) in enumerate(zip(batch.forks, batch.fork_rows)):
            if child.status != SequenceStatus.RUNNING:
                continue
            parent = batch.seqs[row]
            # The prompt's full blocks are the parent's, committed above: same count and hashes.
            child.num_cached_tokens = child.num_tokens
            child.num_committed_blocks = min(parent.num_committed_blocks, child.num_tokens // block_size)
            child.block_hashes = parent.block_hashes[:child.num_committed_blocks]
            child.add_pending_token(len(batch.seqs) + j)
            if child.reached_length(max_model_len):
                self.retire(child)
