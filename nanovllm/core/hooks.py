"""The hooks the core declares: small typed protocols that features implement and the fronts
(`llm.py`, `serve/`) plug in when an option or a request asks for them.

The core calls these protocols and never names a feature: a plain generate with no options runs
the core alone. One section per hook; each feature module says which hook it plugs into.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable  # noqa: F401

if TYPE_CHECKING:
    from nanovllm.core.scheduler import ScheduledBatch, Scheduler
    from nanovllm.core.sequence import Sequence

# ---------------------------------------------------------------- logits (sampling extensions)

# ---------------------------------------------------------------- scheduling
# The scheduler (core/scheduler.py) runs pending prompt work alone, else one decode token for
# every running sequence. A StepPolicy (Scheduler.policy) composes steps otherwise; features
# that follow requests through scheduling are SchedulingHooks (Scheduler.hooks).


class StepPolicy(Protocol):
    """How a step is composed from the scheduler's parts (Scheduler.prompt_work, decode_rows,
    decode_batch) instead of prompt work first (for example decode rows beside prompt chunks)."""

    def compose(self, scheduler: Scheduler) -> ScheduledBatch | None: ...


class SchedulingHook(Protocol):
    """A feature that follows requests from their arrival through scheduling (n > 1 forks,
    prompt logprobs). Every method does nothing here: a feature subclasses this and overrides
    what it needs. Called for a request: `added` once, `reserve` at each admission; for every
    step: `scheduled` once it is composed, `launched` once Scheduler.advance accounted for it."""

    def added(self, seq: Sequence, new_sample: Callable[[int], Sequence]) -> None:
        """A request arrived as `seq` (its sample 0); `new_sample(i)` makes its sample i."""

    def reserve(self, seq: Sequence, block_size: int) -> tuple[int, int]:
        """(sampling rows, free KV blocks) to hold for `seq` from its admission on, beyond its
        own: the rows count against max_num_seqs until the hook pops Scheduler.held_rows[seq];
        the blocks are seq.reserved_blocks (BlockManager.allocate)."""
        return 0, 0

    def scheduled(self, scheduler: Scheduler, batch: ScheduledBatch) -> None:
        """A step was composed: add to it (ScheduledBatch.forks, prompt_rows)."""

    def launched(self, scheduler: Scheduler, batch: ScheduledBatch, max_model_len: int) -> None:
        """The step was launched and its sequences advanced (Scheduler.advance)."""


# ---------------------------------------------------------------- forward strategy (graphs)
