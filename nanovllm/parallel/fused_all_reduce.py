"""All-reduce + residual add + RMSNorm of decode-sized activations in one kernel per rank, over
symmetric memory (the kernel and its protocol: kernels/all_reduce.py)."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from nanovllm.kernels.all_reduce import all_reduce_rms_norm
from nanovllm.kernels.fused_ops import rms_norm
from nanovllm.parallel import device_waits

logger = logging.getLogger(__name__)


def on_every_rank(step, group, device: torch.device, what: str) -> bool:
    """Run `step()` on this rank and return whether it returned True on *every* rank of `group`
    (an exception counts as False and is logged). All or none: a rank alone in a kernel that
    waits for its peers would spin forever. Collective."""
    try:
        ok = step()
    except Exception as e:  # not built with symmetric memory, no NVLink peer access, ...
        logger.info("%s unavailable: %s", what, e)
        ok = False
    flag = torch.tensor([int(bool(ok))], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def create_on_every_rank(make, group, device: torch.device, what: str):
    """`make()` on every rank, then the made object's `_self_check(group)`: the object, or None
    on every rank if either step failed on any rank. Collective."""
    made = None

    def build() -> bool:
        nonlocal made
        made = make()
        return True

    if on_every_rank(build, group, device, what) and on_every_rank(lambda: made._self_check(group), group,
                                                                      device, what):
        return made
    return None


class FusedAllReduceNorm:
    """All-reduce + residual add + RMSNorm of small activations (up to 8 MiB: decode steps, short
    prefill chunks) in one kernel per rank, through symmetric memory over NVLink (the kernel and
    its protocol: kernels/all_reduce.py).

    Replaces, twice per decoder layer, an NCCL all-reduce (at a few hundred rows its cost is
    ring/proxy latency, not bandwidth) and the norm kernel after it. Its device-side waits
    poll an abort word in pinned host memory (read in place by the GPU through unified
    addressing), which `abort_device_waits` sets when a peer dies: the TP watchdog on rank 0,
    and a worker whose rank 0 is gone exits, so a dead peer cannot leave a GPU spinning.
    """

    def __init__(self, group, device: torch.device, dtype: torch.dtype, hidden: int, max_bytes: int,
                 programs: int):
        import torch.distributed._symmetric_memory as symm_mem

        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.dtype, self.hidden = dtype, hidden
        self.max_rows = max(1, max_bytes // (hidden * dtype.itemsize))
        self.abort_word = device_waits.new_abort_word(self)
        self.buffer = symm_mem.empty(2 * self.max_rows * hidden, dtype=dtype, device=device)
        self.flags = symm_mem.empty(programs * self.world_size, dtype=torch.int32, device=device)
        self.flags.zero_()
        addresses = [a for t in (self.buffer, self.flags)
                     for a in self._peer_addresses(symm_mem.rendezvous(t, group.group_name), t)]
        self.addresses = torch.tensor(addresses + [self.abort_word.data_ptr()], dtype=torch.int64, device=device)
        self.phase = torch.zeros(programs, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every rank's flags are zero before anyone raises one

    def _peer_addresses(self, handle, t: torch.Tensor) -> list[int]:
        offset = t.data_ptr() - handle.buffer_ptrs[self.rank]  # the same on every rank
        return [p + offset for p in handle.buffer_ptrs]

    @classmethod
    def create(cls, group, device: torch.device, dtype: torch.dtype, hidden: int, max_bytes: int = 8 << 20):
        """The fused path if it works on every rank of `group` (checked against NCCL + RMSNorm),
        else None. Collective: every rank must call it."""
        if device.type != "cuda":
            return None
        # torch caches symmetric-memory state per group *name* for the life of the process, and
        # a later engine's process group gets the same name ("0") with a new store: a second
        # rendezvous there would wait on the old one forever. So only the first engine of a
        # process uses this path; the ranks agree on it before anyone rendezvouses (the workers
        # are fresh processes and would otherwise try).
        fresh = torch.tensor([int(group.group_name not in device_waits.symmetric_memory_groups)], device=device)
        dist.all_reduce(fresh, op=dist.ReduceOp.MIN, group=group)
        if not fresh.item():
            logger.info("fused all-reduce already used by an earlier engine in this process: NCCL only")
            return None
        device_waits.symmetric_memory_groups.add(group.group_name)
        # Every rank must launch the same grid, and all of its programs must be resident at once
        # (a program spinning at the barrier must never wait for one that cannot be scheduled):
        # at most one program per SM of the smallest GPU.
        sms = torch.tensor([min(128, torch.cuda.get_device_properties(device).multi_processor_count)], device=device)
        dist.all_reduce(sms, op=dist.ReduceOp.MIN, group=group)
        fused = create_on_every_rank(lambda: cls(group, device, dtype, hidden, max_bytes, int(sms.item())),
                                      group, device, "fused all-reduce (NCCL only)")
        if fused is None:
            return None
        logger.info("fused all-reduce + RMSNorm over symmetric memory for up to %d rows", fused.max_rows)
        return fused

    def _self_check(self, group) -> bool:
        """Both buffer halves, against NCCL's all-reduce followed by the plain fused RMSNorm."""
        device = self.buffer.device
        gen = torch.Generator(device=device).manual_seed(1234 + self.rank)
        ok = True
        for rows in (3, self.max_rows):
            x = torch.randn(rows, self.hidden, generator=gen, device=device).to(self.dtype)
            residual = torch.randn(rows, self.hidden, generator=gen, device=device).to(self.dtype)
            dist.broadcast(residual, src=0, group=group)  # ranks share the residual stream
            weight = (1 + 0.2 * torch.randn(self.hidden, generator=gen, device=device)).to(self.dtype)
            dist.broadcast(weight, src=0, group=group)
            summed = x.clone()
            dist.all_reduce(summed, group=group)
            want = rms_norm(summed, weight, 1e-6, residual)
            got = self(x, residual, weight, 1e-6)
            if self.world_size == 2:  # one add: NCCL rounds the same sum the same way
                ok &= all(torch.equal(g, w) for g, w in zip(got, want))
            else:  # NCCL rounds after every hop of its ring, the kernel once
                ok &= all(torch.allclose(g.float(), w.float(), rtol=2e-2, atol=2e-2) for g, w in zip(got, want))
        return bool(ok)

    def symmetric_memory_bytes(self) -> int:
        return self.buffer.nbytes + self.flags.nbytes

    def fits(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        return (residual is not None and x.is_cuda and x.dim() == 2 and x.shape[0] <= self.max_rows and x.shape[1] == self.hidden
                and x.dtype == self.dtype and x.stride(-1) == 1 and residual.stride(-1) == 1)

    def __call__(self, x, residual, weight, eps):
        return all_reduce_rms_norm(x, residual, weight, eps, addresses=self.addresses, phase=self.phase,
                                   max_rows=self.max_rows, rank=self.rank, world_size=self.world_size)
