"""Puts drafted tokens into the scheduler's decode steps (a SchedulingHook, core/hooks.py).

A decode row whose newest token is known on the host (no token of it still on the device) and
whose parameters sample from the plain distribution drafts up to k tokens; in the step, the row
computes its newest token and its drafts (one decode row each to the attention,
verifying_step), the core samples every one of those positions, and Drafting.verify
keeps the tokens that plain decoding would have made (for core/lifecycle.py). Until that step
resolves the row drafts nothing more (Sequence.drafts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol
from weakref import WeakKeyDictionary

from nanovllm.core.hooks import SchedulingHook
from nanovllm.core.sequence import SequenceStatus
from nanovllm.core.step_inputs import StepInput
from nanovllm.features.speculative.options import SpeculativeOptions


class Proposer(Protocol):
    """Where drafts come from (one implementation per method: ngram.py, draft_model.py)."""

    def propose(self, seqs: list, ks: list[int], block_manager) -> list[list[int]]:
        """Up to ks[i] drafted tokens after each sequence's newest one, with the KV slots they
        need taken from `block_manager` (none for a sequence whose slots do not fit)."""

    def verified(self, seq, drafted: int, accepted: int) -> None:
        """The step in flight kept the first `accepted` of `seq`'s `drafted` drafts."""


@dataclass
class DraftCounts:
    """vLLM's spec_decode metrics: verifications of a draft (num_drafts), drafted tokens,
    accepted ones, and accepted ones by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position.extend([0] * (drafted - len(self.accepted_per_position)))
        for j in range(accepted):
            self.accepted_per_position[j] += 1


def draft_counts(scheduler) -> DraftCounts | None:
    """The counts of the Drafting hook among the scheduler's, or None without speculation."""
    return next((h.counts for h in scheduler.hooks if isinstance(h, Drafting)), None)


def take_draft_slots(block_manager, seq, n: int) -> bool:
    """KV slots for `n` drafted tokens past the sequence's tokens, if the free blocks hold them
    (True); else nothing is taken (False)."""
    if block_manager.blocks_for(len(seq) + n) - len(seq.block_table) > block_manager.num_free_blocks:
        return False
    block_manager.append_slot(seq, n)
    return True


def _lays_out_prompt(seq) -> bool:
    """Whether a step with `seq` may fork its samples (n > 1) or plan its prompt logprobs: the
    hooks that do so run after this one and lay out rows of their own, so such a step drafts
    nothing."""
    return bool(seq.pending_forks) or (seq.params.prompt_logprobs is not None
                                       and seq.num_cached_tokens < seq.num_prompt_tokens)


class Drafting(SchedulingHook):
    """Drafts for the decode rows of each step (see the module docstring).

    With overlap scheduling a decode row's newest token is still on the device when the next
    step is scheduled, so nothing can be drafted from it: while the batch is small enough to
    draft, such a row sits out one step (the engine then resolves the step in flight, and the
    row drafts in the next). A row whose proposals keep finding nothing backs off: it decodes
    with overlap for 2, 4, ... 64 tokens before it sits out to try again. `proposer` drafts
    (Proposer: prompt lookup or a draft model)."""

    def __init__(self, options: SpeculativeOptions, proposer: Proposer, max_model_len: int, block_manager,
                 acceptance=None):
        self.options = options
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        self.acceptance = acceptance  # SyntheticAcceptance (synthetic.py), or None: the lossless rule
        self._misses: WeakKeyDictionary = WeakKeyDictionary()  # Sequence -> proposals in a row that missed
        self._retry_at: WeakKeyDictionary = WeakKeyDictionary()  # Sequence -> length at which to try again
        self.counts = DraftCounts()

    def verify(self, seq, sampled: list[int], take) -> list[int]:
        """The DraftVerifier (core/hooks.py) of the lifecycle: `sampled[j]` was drawn after draft
        j with the noise plain decoding would draw there, so keeping sampled[0], then each draft
        while it equals the token sampled before it, gives exactly plain decoding's tokens
        (`acceptance`, for measurements, may keep others). Each is checked in turn (take); the
        first that ends the request is the last."""
        drafts = seq.drafts
        accepted = 0
        if self.acceptance is not None:
            accepted = self.acceptance.accepted(seq, drafts, sampled)
        else:
            while accepted < len(drafts) and drafts[accepted] == sampled[accepted]:
                accepted += 1
        new = []
        for j, token_id in enumerate(drafts[:accepted] + sampled[accepted:accepted + 1]):
            if new:
                seq.token_ids.append(token_id)
            else:
                seq.fill_pending_token(token_id)
            new.append(token_id)
            if take(j, token_id):
                break
        seq.drafts = []
        self.counts.add(len(drafts), accepted)
        self.proposer.verified(seq, len(drafts), accepted)
        if seq.status == SequenceStatus.RUNNING:  # (else finished, or preempted: its blocks are gone)
            self._keep_kv(seq, len(new) - 1)
        return new

    def _keep_kv(self, seq, kept: int) -> None:
        """The K/V of the first `kept` drafts stay (fewer than accepted when a token ended the
        request), the blocks taken for the rest go back (never committed, so nothing to forget
        but their slots), and blocks that became full join the prefix cache."""
        bm = self.block_manager
        seq.num_cached_tokens += kept
        while len(seq.block_table) > bm.blocks_for(len(seq)):
            bm.give_back(seq.block_table.pop())
        if seq.num_cached_tokens >= (seq.num_committed_blocks + 1) * bm.block_size:
            bm.commit(seq)

    def _room(self, seq) -> int:
        """Drafts that fit before the request's length limit (all k + 1 tokens could be kept)."""
        limit = min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len)
        return limit - len(seq) - 1

    def _wants(self, seq, k: int) -> bool:
        """Whether `seq` should draft (or sit out to draft) now: room left, not backing off,
        min_tokens reached, and logits not processed (penalties, bias, bad words, allowed ids
        read the tokens before each position, which differ from drafted position to drafted
        position; logprobs are read per sampling row: those rows draft), but for structured
        outputs, whose mask follows each position's drafts (features/structured/masks.py)."""
        p = seq.params
        processed = p.processes_logits and not (p.structured_outputs is not None and not (
            p.uses_penalties or p.bias or p.allowed_ids is not None or p.bad_word_ids))
        return min(k, self._room(seq)) >= 1 and len(seq) >= self._retry_at.get(seq, 0) \
            and seq.num_completion_tokens >= p.min_tokens and not processed

    def _note(self, seq, drafts: list[int]) -> None:
        """A proposal that found nothing is a miss; misses in a row back off (class docstring)."""
        misses = 0 if drafts else self._misses.get(seq, 0) + 1
        self._misses[seq] = misses
        if misses >= 2:
            self._retry_at[seq] = len(seq) + 2 ** min(misses - 1, 6)

    def scheduled(self, scheduler, batch) -> None:
        if batch.forks or batch.prompt_rows or batch.drafts is not None:
            return
        rows = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
                if n == 1 and s.num_uncomputed_tokens == 1 and s.num_cached_tokens >= s.num_prompt_tokens]
        # Every drafted position is a sampling row and a token: within max_num_seqs (the sampler's
        # and the decode graphs' rows) and max_num_batched_tokens, beside the step's other rows.
        others = len(batch.seqs) - len(rows)
        room = min(scheduler.max_num_seqs - others, scheduler.max_num_batched_tokens - (batch.num_tokens - len(rows)))
        k = self.options.drafts_per_row(len(rows), room)
        if k < 1 or any(map(_lays_out_prompt, batch.seqs)):
            return  # (a prompt's last step: forks and prompt logprobs lay out its rows, later hooks)
        drafts: list[list[int] | None] = [[] for _ in batch.seqs]
        known = []
        for i in rows:
            seq = batch.seqs[i]
            if self._wants(seq, k):
                if seq.has_pending_token:
                    drafts[i] = None  # sits out this step
                else:
                    known.append(i)
        seqs = [batch.seqs[i] for i in known]
        proposed = self.proposer.propose(seqs, [min(k, self._room(s)) for s in seqs], scheduler.block_manager)
        for i, seq, d in zip(known, seqs, proposed):
            self._note(seq, d)
            drafts[i] = d
        if any(d is None or d for d in drafts):
            self._lay_out(batch, drafts)

    @staticmethod
    def _lay_out(batch, drafts: list[list[int] | None]) -> None:
        """Rows sitting out leave the step; the drafts of the others count as new tokens."""
        kept = [i for i, d in enumerate(drafts) if d is not None]
        batch.seqs = [batch.seqs[i] for i in kept]
        batch.num_new_tokens = [batch.num_new_tokens[i] + len(drafts[i]) for i in kept]
        if any(drafts[i] for i in kept):
            batch.drafts = [drafts[i] for i in kept]
            batch.lay_out = verifying_step


def verifying_step(batch) -> StepInput:
    """The StepInput of a step whose rows verify drafts (ScheduledBatch.lay_out): a sequence
    verifying drafts is one entry per position (its newest token, then each draft) over the
    same block table: decode rows to the attention, each context ending at its own position, so
    a decode step with drafts replays the decode graphs like any other. No forks or prompt
    logprobs (Drafting leaves such steps alone)."""
    if batch.forks or batch.prompt_rows:
        raise RuntimeError("internal error: a step with drafts also forks samples or plans prompt logprobs")
    tokens, starts, tables, src, offsets = [], [], [], [], []
    for s, n, d in zip(batch.seqs, batch.num_new_tokens, batch.drafts):
        start = s.num_cached_tokens
        # Each row's noise offset is the index of the token it samples, as a step without
        # drafts would sample it there: verification draws the same noise.
        offsets.extend(len(s) + j for j in range(1 + len(d)))
        if not d:
            tokens.append(s.token_ids[start:start + n] if batch.is_prefill else [s.token_ids[-1]])
            starts.append(start)
            tables.append(s.block_table)
            src.append(s.pending_row)
            continue
        for j, token in enumerate([s.token_ids[start]] + d):
            tokens.append([token])
            starts.append(start + j)
            tables.append(s.block_table)
            src.append(-1)
    step = StepInput(batch.is_prefill, tokens, starts, tables, src if any(r >= 0 for r in src) else None)
    step.sample_offsets = offsets
    return step.with_adapters(batch, [s.adapter_slot for s, d in zip(batch.seqs, batch.drafts)
                                      for _ in range(1 + len(d))])
