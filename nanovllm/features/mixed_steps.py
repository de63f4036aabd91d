"""Mixed steps (`LLM(mixed_steps=True)`, the server's default): decoding sequences never wait for
prompt work. A StepPolicy (core/hooks.py), set when the option is on.

Every step first gives each decoding sequence its one token (preempting as a decode step does),
then spends what is left of the token budget on prompt chunks and admissions; such a step is
prefill-shaped (varlen) with one-token rows for the decoders, last. A step with no prompt work
is a plain decode step (CUDA graphs). No sequence is admitted in a step that preempted one: the
cache is short, and a sequence preempted just now may still wait for its newest token.
"""

from __future__ import annotations

from nanovllm.core.hooks import StepPolicy
from nanovllm.core.scheduler import ScheduledBatch, Scheduler


class MixedSteps(StepPolicy):
    """Decode rows first, then prompt work in the rest of the budget (see the module doc)."""

    def compose(self, scheduler: Scheduler) -> ScheduledBatch | None:
        decoding, preempted = scheduler.decode_rows()
        budget = scheduler.max_num_batched_tokens - len(decoding)
        seqs, counts = scheduler.prompt_work(budget, admit=not preempted)
        if not seqs:
            return scheduler.decode_batch(decoding, preempted) if decoding else None
        return ScheduledBatch(seqs + decoding, counts + [1] * len(decoding), is_prefill=True, preempted=preempted)
