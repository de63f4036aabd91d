"""The tensor-parallel group a model is built for.

Layers read their rank and group size once, at construction, from the group that the
ModelRunner sets with `use_tp_group(...)`, and keep it. So an engine with TP=1 stays
single-rank even in a process where another engine has initialised torch.distributed.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import logging
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F

logger = logging.getLogger("nanovllm")


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object = None  # a torch.distributed ProcessGroup when size > 1
    fused_norm: "FusedAllReduceNorm | None" = None  # fast path for small (<= 8 MiB) CUDA tensors
    copy_engine: "CopyEngineAllReduce | None" = None  # prefill-sized partial sums at TP=2

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def row_parallel(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """This rank's partial sums x @ weight.T of a row-parallel layer (no bias). The caller
        must hand this very tensor to `all_reduce_rms_norm`: prefill-sized ones may already be on
        their way to the peer, and that call finishes the exchange."""
        if self.copy_engine is not None and self.copy_engine.takes(x, weight):
            return self.copy_engine.linear(x, weight)
        return F.linear(x, weight)

    def all_reduce_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        """(norm(s + residual) * weight, s + residual) with s = the sum of `x` over the ranks,
        through the copy-engine exchange that `row_parallel` started for `x`, or the fused
        kernel when `x` fits its buffers; None otherwise (the caller all-reduces and normalises
        separately)."""
        if self.copy_engine is not None and self.copy_engine.is_pending(x):
            return self.copy_engine.finish(x, residual, weight, eps)
        if self.fused_norm is not None and self.fused_norm.fits(x, residual):
            return self.fused_norm(x, residual, weight, eps)
        return None

    def symmetric_memory_bytes(self) -> int:
        """Device memory held by the symmetric-memory paths (not in the caching allocator's count)."""
        return sum(p.symmetric_memory_bytes() for p in (self.fused_norm, self.copy_engine) if p is not None)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x`, stacked in rank order: [size, *x.shape] on every rank."""
        if self.size == 1:
            return x[None]
        parts = [torch.empty_like(x) for _ in range(self.size)]
        # The list form: all_gather_into_tensor is deprecated in torch 2.13 and gloo wants other
        # shapes there; for the small tensors this serves, the copies do not matter.
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.stack(parts)

    def gather_to_rank0(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `x` on rank 0 (in rank order); None on the other ranks."""
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return parts


_SYMM_MEM_GROUP_NAMES: set[str] = set()  # see FusedAllReduceNorm.create
# Every live FusedAllReduceNorm / CopyEngineAllReduce of this process, so that a watchdog can
# release their device-side waits even while the model runner that owns one is still being built.
_LIVE_DEVICE_WAITERS: weakref.WeakSet = weakref.WeakSet()


def _new_abort_word(owner) -> torch.Tensor:
    """A zeroed int32 in pinned host memory that `owner`'s device-side waits poll (read in place
    through unified addressing); `abort_device_waits` sets it."""
    word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    _LIVE_DEVICE_WAITERS.add(owner)
    return word


def _on_every_rank(step, group, device: torch.device, what: str) -> bool:
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


def _create_on_every_rank(make, group, device: torch.device, what: str):
    """`make()` on every rank, then the made object's `_self_check(group)`: the object, or None
    on every rank if either step failed on any rank. Collective."""
    made = None

    def build() -> bool:
        nonlocal made
        made = make()
        return True

    if _on_every_rank(build, group, device, what) and _on_every_rank(lambda: made._self_check(group), group,
                                                                      device, what):
        return made
    return None


def abort_device_waits() -> None:
    """Make every device-side wait for a peer in this process give up, for good (a peer died):
    the fused kernel and the copy-engine wait then finish with meaningless sums, and the engine
    must be closed."""
    for waiter in list(_LIVE_DEVICE_WAITERS):
        waiter.abort_word[0] = 1


class FusedAllReduceNorm:
    """All-reduce + residual add + RMSNorm of small activations (up to 8 MiB: decode steps, short
    prefill chunks) in one kernel per rank, through symmetric memory over NVLink (the kernel and
    its protocol: kernels/all_reduce.py).

    Replaces, twice per decoder layer, an NCCL all-reduce (~15-25 us at a few hundred rows:
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
        self.abort_word = _new_abort_word(self)
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
        fresh = torch.tensor([int(group.group_name not in _SYMM_MEM_GROUP_NAMES)], device=device)
        dist.all_reduce(fresh, op=dist.ReduceOp.MIN, group=group)
        if not fresh.item():
            logger.info("fused all-reduce already used by an earlier engine in this process: NCCL only")
            return None
        _SYMM_MEM_GROUP_NAMES.add(group.group_name)
        # Every rank must launch the same grid, and all of its programs must be resident at once
        # (a program spinning at the barrier must never wait for one that cannot be scheduled):
        # at most one program per SM of the smallest GPU.
        sms = torch.tensor([min(128, torch.cuda.get_device_properties(device).multi_processor_count)], device=device)
        dist.all_reduce(sms, op=dist.ReduceOp.MIN, group=group)
        fused = _create_on_every_rank(lambda: cls(group, device, dtype, hidden, max_bytes, int(sms.item())),
                                      group, device, "fused all-reduce (NCCL only)")
        if fused is None:
            return None
        logger.info("fused all-reduce + RMSNorm over symmetric memory for up to %d rows", fused.max_rows)
        return fused

    def _self_check(self, group) -> bool:
        """Both buffer halves, against NCCL's all-reduce followed by the plain fused RMSNorm."""
        from nanovllm.kernels.fused_ops import rms_norm

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
        from nanovllm.kernels.all_reduce import all_reduce_rms_norm

        return all_reduce_rms_norm(x, residual, weight, eps, addresses=self.addresses, phase=self.phase,
                                   max_rows=self.max_rows, rank=self.rank, world_size=self.world_size)


class CopyEngineAllReduce:
    """The all-reduce of prefill-sized partial sums at TP=2, hidden behind the GEMM making them.

    NCCL takes ~0.45 ms for a 16k-row all-reduce (128 MiB) and cannot run beside cuBLAS: its
    kernel needs SMs the GEMM holds (BENCHMARKS.md). Copy engines need no SMs. So the row-parallel
    GEMM runs in row chunks, and as each chunk finishes a side stream copies it into the peer's
    receive buffer (cudaMemcpyAsync over NVLink, ~385 GB/s on H200) and then writes the number of
    chunks sent so far into the peer's counter (cuStreamWriteValue32, ordered after the copy). The
    norm after the layer waits on the device for the peer's count and adds the received rows in
    its residual + RMSNorm kernel, so only the last chunk's copy is left exposed. On 2xH200 it
    took TP=2's prefill phase of the bench from 1.85 s to 1.70-1.77 s (BENCHMARKS.md).

    Two ranks only: with N ranks each would copy its rows N - 1 times, where NCCL's ring moves
    2(N - 1)/N of them. Rows: MIN_ROWS .. max_rows (below, NCCL is as fast: no gain at 4k rows).

    Layout per rank: recv [2, max_rows, hidden], count int32 [1]. Exchanges alternate halves. A
    rank writes half h again two exchanges later, and only after its own exchange in between
    received the peer's rows, which the peer sends after (stream order) its norm of the exchange
    before, i.e. after it finished reading half h. Both ranks send the same number of chunks in
    the same order (they run the same batches), so each waits for its own count of chunks sent.
    """

    MIN_ROWS = 8192
    CHUNK_ROWS = 4096  # 2-4 chunks: the best counts at 8k-16k rows, measured with a wide spread

    def __init__(self, group, device: torch.device, dtype: torch.dtype, hidden: int, max_rows: int):
        import torch.distributed._symmetric_memory as symm_mem
        from torch._C._distributed_c10d import _SymmetricMemory

        if dist.get_world_size(group) != 2:
            raise ValueError("the copy-engine all-reduce is for two ranks")
        self.dtype, self.hidden, self.max_rows = dtype, hidden, max_rows
        self.abort_word = _new_abort_word(self)
        self.abort_address = torch.tensor([self.abort_word.data_ptr()], dtype=torch.int64, device=device)
        self._write_value = _SymmetricMemory.stream_write_value32
        peer = 1 - dist.get_rank(group)
        recv = symm_mem.empty(2 * max_rows * hidden, dtype=dtype, device=device)
        self.count = symm_mem.empty(1, dtype=torch.int32, device=device)
        self.count.zero_()
        self.peer_recv = symm_mem.rendezvous(recv, group.group_name).get_buffer(peer, (2, max_rows, hidden), dtype)
        # cuStreamWriteValue32 takes a uint32 word; the waiting kernel reads it as int32.
        self.peer_count = symm_mem.rendezvous(self.count, group.group_name).get_buffer(peer, (1,), torch.uint32)
        self.recv = recv.view(2, max_rows, hidden)
        self.side = torch.cuda.Stream(device)
        self.sent = 0  # chunks sent so far, and so the count the peer's chunks reach here
        self.exchanges = 0
        self._pending = None  # (partial sums, half) of the exchange the next norm finishes
        self._broken = False  # an exchange failed half-way: the ranks' counts may disagree
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every rank's count is zero before anyone writes one

    @classmethod
    def create(cls, group, device: torch.device, dtype: torch.dtype, hidden: int, max_rows: int):
        """The copy-engine path if it works on every rank of `group` (checked against chunked
        GEMMs + NCCL + RMSNorm), else None. Two ranks, after FusedAllReduceNorm.create succeeded
        in this engine (it owns the symmetric-memory rendezvous of the group). Collective."""
        if dist.get_world_size(group) != 2 or group.group_name not in _SYMM_MEM_GROUP_NAMES:
            return None  # not two ranks, or no fused path in this engine (see above)
        if max_rows < cls.MIN_ROWS:
            logger.info("copy-engine all-reduce off: prefill steps of at most %d tokens are below its %d rows",
                        max_rows, cls.MIN_ROWS)
            return None
        made = _create_on_every_rank(lambda: cls(group, device, dtype, hidden, max_rows), group, device,
                                     "copy-engine all-reduce (NCCL for prefill)")
        if made is None:
            return None
        logger.info("copy-engine all-reduce for %d-%d rows", cls.MIN_ROWS, max_rows)
        return made

    def symmetric_memory_bytes(self) -> int:
        return self.recv.nbytes + self.count.nbytes

    def takes(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        # Eager prefill only: a CUDA graph would freeze the chunk counts it waits for.
        return (x.is_cuda and x.dim() == 2 and self.MIN_ROWS <= x.shape[0] <= self.max_rows
                and x.dtype == self.dtype and weight.shape[0] == self.hidden
                and not torch.cuda.is_current_stream_capturing())

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T (this rank's partial sums), each row chunk sent to the peer as soon as
        the GEMM has produced it. `finish` must follow before the next exchange."""
        self._usable()
        if self._pending is not None:
            raise RuntimeError("copy-engine all-reduce: the previous exchange was never finished (its partial "
                               "sums must go to TPGroup.all_reduce_rms_norm as returned)")
        rows = x.shape[0]
        if rows > self.max_rows:
            raise ValueError(f"{rows} rows exceed the receive buffer's {self.max_rows}")
        y = torch.empty(rows, self.hidden, dtype=x.dtype, device=x.device)
        y.record_stream(self.side)  # its memory is not reused before the copies have read it
        half = self.exchanges % 2
        step = self._chunk_rows(rows)
        try:
            self.exchanges += 1
            for start in range(0, rows, step):
                stop = min(rows, start + step)
                torch.mm(x[start:stop], weight.t(), out=y[start:stop])
                self.side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.side):
                    self.peer_recv[half, start:stop].copy_(y[start:stop], non_blocking=True)
                    self.sent += 1
                    self._write_value(self.peer_count, 0, self.sent)
        except BaseException:
            self._broken = True  # the peer may have sent more chunks than we did
            raise
        self._pending = (y, half)
        return y

    def _usable(self) -> None:
        if self._broken:
            raise RuntimeError("copy-engine all-reduce: an earlier exchange failed half-way, so the ranks' "
                               "chunk counts may disagree; this engine must be restarted")

    def _chunk_rows(self, rows: int) -> int:
        return -(-rows // max(1, rows // self.CHUNK_ROWS))

    def is_pending(self, x: torch.Tensor) -> bool:
        return self._pending is not None and self._pending[0] is x

    def finish(self, y: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        """(norm(s + residual) * weight, s + residual), s = y + the peer's partial sums; y must
        be the tensor the last `linear` returned."""
        from nanovllm.kernels.all_reduce import wait_count
        from nanovllm.kernels.fused_ops import rms_norm

        self._usable()
        if not self.is_pending(y):
            raise RuntimeError("copy-engine all-reduce: finish() needs the partial sums of the last linear()")
        half = self._pending[1]
        try:
            wait_count(self.count, self.sent, self.abort_address)
            out = rms_norm(y, weight, eps, residual, addend=self.recv[half, :y.shape[0]])
        except BaseException:
            self._broken = True  # a wait may be queued whose rows nobody reads
            raise
        self._pending = None
        return out

    def _self_check(self, group) -> bool:
        """Both halves and a partial last chunk, bitwise against the same GEMM chunks summed by
        NCCL and normalised by the RMSNorm kernel (two ranks: one add, rounded alike)."""
        from nanovllm.kernels.fused_ops import rms_norm

        device = self.recv.device
        gen = torch.Generator(device=device).manual_seed(4321 + dist.get_rank(group))
        ok = True
        for rows in (min(self.MIN_ROWS + 3, self.max_rows), self.max_rows):
            x = torch.randn(rows, 256, generator=gen, device=device).to(self.dtype)
            w = (torch.randn(self.hidden, 256, generator=gen, device=device) / 16).to(self.dtype)
            residual = torch.randn(rows, self.hidden, generator=gen, device=device).to(self.dtype)
            dist.broadcast(residual, src=0, group=group)
            norm_w = (1 + 0.2 * torch.randn(self.hidden, generator=gen, device=device)).to(self.dtype)
            dist.broadcast(norm_w, src=0, group=group)
            got = self.finish(self.linear(x, w), residual, norm_w, 1e-6)
            step = self._chunk_rows(rows)
            summed = torch.cat([torch.mm(x[i:i + step], w.t()) for i in range(0, rows, step)])
            dist.all_reduce(summed, group=group)
            want = rms_norm(summed, norm_w, 1e-6, residual)
            ok &= all(torch.equal(g, w_) for g, w_ in zip(got, want))
        return bool(ok)


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
