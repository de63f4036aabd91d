"""Prompt logprobs (`SamplingParams.prompt_logprobs`): the logprob of every prompt token after the
first, from the logits of the prefill steps. A SchedulingHook (core/hooks.py), registered by the
first request that asks; the sampler gathers the log-softmax at the rows planned here.

Position p of a prompt predicts its token p + 1, so each prefill step also returns the logits of
its packed positions that predict a prompt token (ScheduledBatch.prompt_rows): the last prompt
token predicts none, and positions an earlier step already planned are skipped (a prompt
recomputed after preemption). Until every position is planned the sequence reads no cached
prefix (Sequence.reads_prefix_cache): a prefix hit computes no logits.
"""

from __future__ import annotations

from nanovllm.core.hooks import SchedulingHook
from nanovllm.core.scheduler import ScheduledBatch, Scheduler
from nanovllm.core.sequence import Sequence


def _all_planned(seq: Sequence) -> bool:
    return seq.num_prompt_logprobs_planned >= seq.num_prompt_tokens - 1


class PromptLogprobs(SchedulingHook):
    """Plans the prompt positions each prefill step returns logits for (see the module doc)."""

    def added(self, seq: Sequence, new_sample) -> None:
        if seq.prompt_logprobs is not None:
            seq.reads_prefix_cache = _all_planned(seq)

    def scheduled(self, scheduler: Scheduler, batch: ScheduledBatch) -> None:
        if not batch.is_prefill:
            return
        rows, targets, owners, packed = [], [], [], 0
        for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if s.prompt_logprobs is not None and not _all_planned(s):
                start = s.num_cached_tokens
                lo, hi = max(start, s.num_prompt_logprobs_planned), min(start + n, s.num_prompt_tokens - 1)
                if hi > lo:
                    rows.extend(range(packed + lo - start, packed + hi - start))
                    targets.extend(s.token_ids[lo + 1:hi + 1])
                    owners.append((i, hi - lo, s.params.prompt_logprobs))
                s.num_prompt_logprobs_planned = max(s.num_prompt_logprobs_planned, hi)
                s.reads_prefix_cache = _all_planned(s)
            packed += n
        if rows:
            batch.prompt_rows, batch.prompt_targets, batch.prompt_owners = rows, targets, owners
