"""Preemption by recompute (Scheduler.decode_rows, when a decoding sequence needs a KV block and
none is free), reached through scheduler.PREEMPTION."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanovllm.core.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from nanovllm.core.scheduler import Scheduler


def make_room(scheduler: Scheduler, seq: Sequence, preempted: list[Sequence]) -> bool:
    """Preempt the newest running sequences (they have done the least work to throw away) until
    `seq` can get a block; False when `seq` itself was preempted. Appends each to `preempted`."""
    while not scheduler.block_manager.can_append(seq):
        victim = scheduler.running.pop() if scheduler.running else seq
        preempt(scheduler, victim)
        preempted.append(victim)
        if victim is seq:
            return False
    return True


def preempt(scheduler: Scheduler, seq: Sequence) -> None:
    """Free the sequence's blocks and put it back at the front of the queue, to be recomputed."""
    scheduler.held_rows.pop(seq, None)
    scheduler.block_manager.free(seq)
    seq.status = SequenceStatus.WAITING
    seq.num_preemptions += 1
    scheduler.num_preemptions += 1
    scheduler.waiting.appendleft(seq)
