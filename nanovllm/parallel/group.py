"""The tensor-parallel group a model is built for. Layers read their rank and group size once, at
construction, from the group the ModelRunner sets with `use_tp_group(...)`: an engine with TP=1
stays single-rank even in a process where another engine has initialised torch.distributed."""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPGroup:
    """A single rank's tensor-parallel group, whose collectives return their input (DistributedTPGroup
    runs them over the ranks). `rank` and `size` alone also build a rank's shard of the layers (tests)."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def row_parallel(self, x: torch.Tensor, layer) -> torch.Tensor:
        return layer.matmul(x)

    def symmetric_memory_bytes(self) -> int:
        return 0

    def agree_on_min(self, value: int, device: torch.device) -> int:
        return value


_CURRENT: contextvars.ContextVar[TPGroup] = contextvars.ContextVar("nanovllm_tp_group", default=TPGroup())


@contextmanager
def use_tp_group(group: TPGroup):
    """Build layers for `group` inside this block."""
    token = _CURRENT.set(group)
    try:
        yield group
    finally:
        _CURRENT.reset(token)


def current_tp_group() -> TPGroup:
    return _CURRENT.get()


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator
