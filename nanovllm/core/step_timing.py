"""What `LLMEngine.step_observers` are given: a StepTiming per engine step, with the step's shape
(StepShape) taken at its launch. The engine loads this module at the first step someone observes
(through the loader nanovllm/wiring/ registers), so a plain generate never does."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple

from nanovllm.core.scheduler import ScheduledBatch

if TYPE_CHECKING:
    from nanovllm.core.lifecycle import InFlightStep


@dataclass(frozen=True)
class StepTiming:
    """One engine step as the host saw it, for `LLMEngine.step_observers`: the step resolved
    (0 tokens: the first step only launched), how long the host waited for its tokens, the
    time.perf_counter() at return, and its shape as launched (StepShape; zeros for the first)."""

    is_prefill: bool
    num_tokens: int
    wait_s: float
    ended_at: float
    num_seqs: int = 0
    context_tokens: int = 0
    attention_pairs: int = 0


class StepShape(NamedTuple):
    """What a step computes, for roofline estimates: num_seqs sequences attending over
    context_tokens K/V entries (cached + new, summed), in attention_pairs (query, key) pairs
    under the causal mask (= context_tokens for a decode step)."""

    num_seqs: int
    context_tokens: int
    attention_pairs: int

    @classmethod
    def of(cls, batch: ScheduledBatch) -> "StepShape":
        """The shape of a batch about to launch (num_cached_tokens not yet advanced); one pass
        over the batch, so the engine computes it only while someone observes its steps."""
        seqs = batch.seqs
        if not batch.is_prefill:  # one new token each, attending over its cached tokens and itself
            context = sum(s.num_cached_tokens for s in seqs) + len(seqs)
            return cls(len(seqs), context, context)
        context = pairs = 0
        for s, n in zip(seqs, batch.num_new_tokens):
            c = s.num_cached_tokens
            context += c + n
            pairs += n * c + n * (n + 1) // 2  # new token j sees the c cached ones and j + 1 new ones
        return cls(len(seqs), context, pairs)



def observe(observers: list[Callable[[StepTiming], None]], step: InFlightStep, resolved: bool, waited: float) -> None:
    """Give each observer the StepTiming of `step`: the step resolved or (resolved False) the
    first one, which only launched."""
    # A step launched before the first observer came has no shape: zeros, as unresolved.
    shape = step.shape if resolved and step.shape is not None else (0, 0, 0)
    timing = StepTiming(step.batch.is_prefill, step.batch.num_tokens if resolved else 0, waited,
                        time.perf_counter(), *shape)
    for observer in observers:
        observer(timing)
