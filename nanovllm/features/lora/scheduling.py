"""Which adapter sits in which of the model's `max_loras` slots (a SchedulingHook, rank 0): a
waiting request starts only once its adapter has a slot; a slot is free when no running request
uses its adapter, and the least recently used such slot is refilled. A refill travels with the
step that first needs it (ScheduledBatch.adapter_loads), so every tensor-parallel rank loads it
before that step's forward."""

from __future__ import annotations

from collections import OrderedDict

from nanovllm.core.hooks import SchedulingHook


class LoraSlots(SchedulingHook):
    def __init__(self, max_loras: int, registry: dict):
        self.max_loras = max_loras
        self.registry = registry  # adapter id -> LoRARequest (the front's)
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recent first
        self.pending: list[tuple] = []

    def admit(self, scheduler, seq) -> bool:
        if not seq.adapter:
            seq.adapter_slot = -1
            return True
        slot = self.slot_of.get(seq.adapter)
        if slot is None:
            slot = self._free_slot(scheduler, seq)
            if slot is None:
                return False  # every slot serves running requests: wait for one to end
            for other, s in list(self.slot_of.items()):
                if s == slot:
                    del self.slot_of[other]
            request = self.registry[seq.adapter]
            self.pending.append((slot, seq.adapter, request.lora_name, request.lora_path))
        self.slot_of[seq.adapter] = slot
        self.slot_of.move_to_end(seq.adapter)
        seq.adapter_slot = slot
        return True

    def _free_slot(self, scheduler, seq) -> int | None:
        taken = set(self.slot_of.values())
        empty = [s for s in range(self.max_loras) if s not in taken]
        if empty:
            return empty[0]
        in_use = {s.adapter for s in scheduler.running}
        return next((s for a, s in self.slot_of.items() if a not in in_use and a != seq.adapter), None)

    def scheduled(self, scheduler, batch) -> None:
        for seq in batch.seqs + batch.forks:  # (forked samples run with their request's adapter)
            if seq.adapter:
                seq.adapter_slot = self.slot_of[seq.adapter]
        if self.pending:
            batch.adapter_loads, self.pending = self.pending, []
