"""The tensor-parallel group a model is built for.

Layers read their rank and group size once, at construction, from the group that the
ModelRunner sets with `use_tp_group(...)`, and keep it. So an engine with TP=1 stays
single-rank even in a process where another engine has initialised torch.distributed.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object = None  # a torch.distributed ProcessGroup when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_to_rank0(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `x` on rank 0 (in rank order); None on the other ranks."""
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return parts


_SINGLE = TPGroup()
_current = _SINGLE


@contextmanager
def use_tp_group(group: TPGroup):
    """Build layers for `group` inside this block."""
    global _current
    previous, _current = _current, group
    try:
        yield group
    finally:
        _current = previous


def current_tp_group() -> TPGroup:
    return _current


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator
