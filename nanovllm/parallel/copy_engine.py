"""The all-reduce of prefill-sized partial sums at TP=2, sent by copy engine beside the GEMM."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from nanovllm.kernels.all_reduce import wait_count
from nanovllm.kernels.fused_ops import rms_norm
from nanovllm.parallel import device_waits
from nanovllm.parallel.fused_all_reduce import create_on_every_rank

logger = logging.getLogger(__name__)


class CopyEngineAllReduce:
    """The all-reduce of prefill-sized partial sums at TP=2, hidden behind the GEMM making them.

    NCCL's all-reduce of a prefill step's rows cannot run beside cuBLAS: its kernel needs SMs the
    GEMM holds. Copy engines need no SMs. So the row-parallel
    GEMM runs in row chunks, and as each chunk finishes a side stream copies it into the peer's
    receive buffer (cudaMemcpyAsync over NVLink) and then writes the number of
    chunks sent so far into the peer's counter (cuStreamWriteValue32, ordered after the copy). The
    norm after the layer waits on the device for the peer's count and adds the received rows in
    its residual + RMSNorm kernel, so only the last chunk's copy is left exposed (what it saves:
    BENCHMARKS.md, TP=2).

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
        self.abort_word = device_waits.new_abort_word(self)
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
        if dist.get_world_size(group) != 2 or group.group_name not in device_waits.symmetric_memory_groups:
            return None  # not two ranks, or no fused path in this engine (see above)
        if max_rows < cls.MIN_ROWS:
            logger.info("copy-engine all-reduce off: prefill steps of at most %d tokens are below its %d rows",
                        max_rows, cls.MIN_ROWS)
            return None
        made = create_on_every_rank(lambda: cls(group, device, dtype, hidden, max_rows), group, device,
                                     "copy-engine all-reduce (NCCL for prefill)")
        if made is None:
            return None
        logger.info("copy-engine all-reduce for %d-%d rows", cls.MIN_ROWS, max_rows)
        return made

    def symmetric_memory_bytes(self) -> int:
        return self.recv.nbytes + self.count.nbytes

    def takes(self, x: torch.Tensor, out_features: int) -> bool:
        # Eager prefill only: a CUDA graph would freeze the chunk counts it waits for.
        return (x.is_cuda and x.dim() == 2 and self.MIN_ROWS <= x.shape[0] <= self.max_rows
                and x.dtype == self.dtype and out_features == self.hidden
                and not torch.cuda.is_current_stream_capturing())

    def linear(self, x: torch.Tensor, matmul_into) -> torch.Tensor:
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
                matmul_into(x[start:stop], y[start:stop])
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
            got = self.finish(self.linear(x, lambda a, out: torch.mm(a, w.t(), out=out)), residual, norm_w, 1e-6)
            step = self._chunk_rows(rows)
            summed = torch.cat([torch.mm(x[i:i + step], w.t()) for i in range(0, rows, step)])
            dist.all_reduce(summed, group=group)
            want = rms_norm(summed, norm_w, 1e-6, residual)
            ok &= all(torch.equal(g, w_) for g, w_ in zip(got, want))
        return bool(ok)
