"""The tensor-parallel group a model is built for.

Layers read their rank and group size once, at construction, from the group that the
ModelRunner sets with `use_tp_group(...)`, and keep it. So an engine with TP=1 stays
single-rank even in a process where another engine has initialised torch.distributed.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger("nanovllm")


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object = None  # a torch.distributed ProcessGroup when size > 1
    one_shot: "OneShotAllReduce | None" = None  # fast path for small CUDA tensors

    def all_reduce(self, x: torch.Tensor, one_shot: bool = True) -> torch.Tensor:
        """Sum `x` over the ranks, in place. `one_shot=False` keeps a call on NCCL, for a caller
        that runs an odd number of times per forward (see OneShotAllReduce)."""
        if self.size > 1:
            if one_shot and self.one_shot is not None and self.one_shot.fits(x):
                return self.one_shot(x)
            dist.all_reduce(x, group=self.group)
        return x

    def gather_to_rank0(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `x` on rank 0 (in rank order); None on the other ranks."""
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return parts


_SYMM_MEM_GROUP_NAMES: set[str] = set()  # see OneShotAllReduce.create


class OneShotAllReduce:
    """All-reduce of small CUDA tensors through symmetric memory over NVLink.

    Every rank copies its input into a buffer that all ranks can read, and one kernel per rank
    (torch's symm_mem one_shot_all_reduce) waits for the others at a device-side barrier and
    sums all buffers straight from peer memory. At decode sizes (<= a few MiB) that is one hop
    and no NCCL ring or proxy thread: NCCL's all-reduce costs ~15-25 us there, twice per layer.

    Two buffers alternate so that a rank can write the next input while a slower peer is still
    reading the previous one: to overwrite a buffer a rank must first pass the barrier of the
    call in between, which the peer only reaches after its read. Calls through here must come
    in pairs per forward pass (the two row-parallel layers of every decoder layer), so each
    forward, and each CUDA graph, starts on the same buffer.

    Opt-in (`LLM(..., custom_all_reduce=True)`): measured 3% faster for Qwen3-8B at TP=2 on
    H200s, but its device-side barrier spins with no timeout, so a worker that dies mid-step
    leaves rank 0's GPU stuck in that kernel, where NCCL's communicator can be aborted.
    """

    def __init__(self, group, device: torch.device, dtype: torch.dtype, max_bytes: int):
        import torch.distributed._symmetric_memory as symm_mem

        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        self.group_name = group.group_name
        self.buffers = []
        for _ in range(2):
            buf = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
            symm_mem.rendezvous(buf, self.group_name)
            self.buffers.append(buf)
        self._next = 0

    @classmethod
    def create(cls, group, device: torch.device, dtype: torch.dtype, max_bytes: int = 8 << 20):
        """The fast path if it works on every rank of `group` (checked against NCCL), else None.
        Collective: every rank must call it."""
        if device.type != "cuda":
            return None
        # torch caches symmetric-memory state per group *name* for the life of the process, and
        # a later engine's process group gets the same name ("0") with a new store: a second
        # rendezvous there would wait on the old one forever. So only the first engine of a
        # process uses this path; the ranks agree on it before anyone rendezvouses (the workers
        # are fresh processes and would otherwise try).
        fresh = torch.tensor([int(group.group_name not in _SYMM_MEM_GROUP_NAMES)], device=device)
        dist.all_reduce(fresh, op=dist.ReduceOp.MIN, group=group)
        if not fresh.item():
            logger.info("one-shot all-reduce already used by an earlier engine in this process: NCCL only")
            return None
        _SYMM_MEM_GROUP_NAMES.add(group.group_name)
        ok, fast = True, None
        try:
            fast = cls(group, device, dtype, max_bytes)
            rank = dist.get_rank(group)
            x = torch.arange(4096, device=device, dtype=dtype) % 61 + rank
            want = x.clone()
            dist.all_reduce(want, group=group)
            for _ in range(2):  # both buffers
                ok &= torch.equal(fast(x.clone()), want)
        except Exception as e:  # not built with symmetric memory, no NVLink peer access, ...
            logger.info("one-shot all-reduce unavailable, using NCCL only: %s", e)
            ok = False
        flag = torch.tensor([int(ok)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)  # all ranks or none
        if not flag.item():
            return None
        logger.info("one-shot all-reduce over symmetric memory for tensors up to %d MiB", max_bytes >> 20)
        return fast

    def fits(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.dtype == self.dtype and x.numel() <= self.max_numel and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        buf = self.buffers[self._next][:x.numel()]
        self._next ^= 1
        flat = x.view(-1)
        buf.copy_(flat)
        torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", self.group_name, flat)
        return x


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
