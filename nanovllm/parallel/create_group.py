"""How a tensor-parallel rank creates its TPGroup over the initialised process group, with the
symmetric-memory all-reduce paths where they work. The launchers (launch/) call it on every
rank; a single-rank engine never loads this module."""

from __future__ import annotations

import torch
import torch.distributed as dist

from nanovllm.parallel.copy_engine import CopyEngineAllReduce
from nanovllm.parallel.fused_all_reduce import FusedAllReduceNorm
from nanovllm.parallel.distributed_group import DistributedTPGroup


def create_tp_group(world_size: int, device: torch.device, dtype: torch.dtype, hidden_size: int,
                    max_num_batched_tokens: int, custom_all_reduce: bool) -> DistributedTPGroup:
    """This rank's TPGroup over the initialised default process group (or a single rank), with
    the symmetric-memory all-reduce paths where they work (NVLink GPUs, `custom_all_reduce`).
    Collective when world_size > 1: every rank must call it."""
    if world_size == 1:
        return DistributedTPGroup()  # (a launcher's single rank: the collectives of size 1 do nothing)
    group = dist.group.WORLD
    rank = dist.get_rank()
    fused_norm = copy_engine = None
    if device.type == "cuda" and custom_all_reduce:
        fused_norm = FusedAllReduceNorm.create(group, device, dtype, hidden_size)
        if fused_norm is not None:  # it owns the group's symmetric-memory rendezvous
            # Up to 128 MiB per buffer half (16k rows of Qwen3-8B); longer prefill steps use NCCL.
            max_rows = min(max_num_batched_tokens, (128 << 20) // (hidden_size * dtype.itemsize))
            copy_engine = CopyEngineAllReduce.create(group, device, dtype, hidden_size, max_rows)
    return DistributedTPGroup(rank, world_size, group, fused_norm, copy_engine)
