"""All-reduce of tensor-parallel partial sums fused with the residual add and RMSNorm after it.

Row-parallel layers (o_proj, down_proj) leave every rank with a partial sum of each output row,
and the decoder layer then adds the residual and normalises. At decode sizes (a few hundred
rows) NCCL's all-reduce is latency-bound, twice per layer, plus a norm kernel (BENCHMARKS.md). Here
one kernel per rank does it all: each program copies its rows of this rank's partial sums into
a staging buffer that every rank can address (torch symmetric memory, peer-mapped over NVLink),
meets the program with the same index on every other rank at a flag barrier, then sums those
rows straight from the peers' buffers, adds the residual and normalises.

Layouts and protocol (all ranks launch the same grid, G programs, for every call):
- staging buffer per rank: [2, max_rows, n_cols] in the activation dtype. Calls alternate
  between the two halves (`phase`, a per-program call counter on each rank's device), so a
  rank may fill a half again only after passing the barrier of the call in between, which its
  peers reach only once they have finished reading that half.
- flags per rank: int32 [G, WORLD], all zero between calls. Program p of rank r raises flag
  [p, r] on every peer (compare-and-swap 0 -> 1, release: its copied rows are visible before
  the flag), then lowers flag [p, q] of its own pad for every peer q (1 -> 0, acquire). A raise
  waits while the peer has not yet consumed the previous one, so flags never get lost.
- every spin polls an abort word now and then (pinned host memory, read in place; rank 0's
  watchdog sets it when a worker dies, and a worker whose rank 0 died exits), so a dead peer
  cannot leave a GPU spinning forever. All programs must be resident at once: the grid is at
  most one program per SM.
Programs sum the ranks in rank order with fp32 accumulation, so every rank computes bitwise the
same rows (ranks must keep identical residual streams).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fused_ops import _num_warps, _rms_norm_row

# Polling host memory costs a PCIe round trip; do it once per this many failed spins.
_ABORT_POLL_INTERVAL = 1024


@triton.jit
def _abort_word(abort_ptr):
    """The abort word, the same value in every thread of the program."""
    # Every thread reads the word on its own; the reduction hands all of them one value, so no
    # warp leaves a spin loop (with its barriers) an iteration before the others.
    lanes = tl.arange(0, 32)
    return tl.max(tl.load(abort_ptr + lanes * 0, volatile=True), axis=0)


@triton.jit
def _spin_cas(ptr, expected, desired, abort_ptr, SEM: tl.constexpr, POLL: tl.constexpr):
    """Compare-and-swap *ptr from `expected` to `desired` at system scope, retrying until it
    succeeds or *abort_ptr is non-zero. Returns the abort word (0: the swap happened)."""
    old = tl.atomic_cas(ptr, expected, desired, sem=SEM, scope="sys")
    aborted = 0
    spins = 0
    while (old != expected) & (aborted == 0):
        spins += 1
        if spins % POLL == 0:
            aborted = _abort_word(abort_ptr)
        old = tl.atomic_cas(ptr, expected, desired, sem=SEM, scope="sys")
    return aborted


# Not specialised on the row count: one compiled kernel serves every batch size (a first launch
# of a new variant loads a module, which waits for the device, while a peer may be waiting on us).
@triton.jit(do_not_specialize=["n_rows"])
def _all_reduce_rms_norm_kernel(
    x_ptr,
    x_stride,
    res_ptr,
    res_stride,
    w_ptr,
    y_ptr,
    res_out_ptr,
    addr_ptr,
    phase_ptr,
    n_rows,
    n_cols,
    max_rows,
    eps,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    POLL: tl.constexpr,
):
    """s = sum over ranks of x_rank[r] (fp32, rounded to the dtype), then like _rms_norm_kernel:
    res_out[r] = (s + residual[r]) rounded, y[r] = norm(res_out[r]) * weight.

    x / residual: [n_rows, n_cols] row views (last dim contiguous); y, res_out contiguous.
    addr_ptr: int64 [2 * WORLD + 1], the addresses of every rank's staging buffer, then of
    every rank's flag pad, then of this rank's abort word (host-mapped int32).
    phase_ptr: int32 [G] on this rank.
    Program p handles rows p, p + G, ... (G = number of programs, the same on every rank).
    """
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    dtype = y_ptr.dtype.element_ty
    abort_ptr = tl.load(addr_ptr + 2 * WORLD).to(tl.pointer_type(tl.int32))
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    phase = tl.load(phase_ptr + pid)
    tl.store(phase_ptr + pid, phase + 1)  # wraps after 2**31 calls; its parity stays right
    half = (phase & 1).to(tl.int64) * max_rows * n_cols

    own = tl.load(addr_ptr + RANK).to(tl.pointer_type(dtype)) + half
    for i in range(pid, n_rows, num_programs):
        row = tl.cast(i, tl.int64)
        x = tl.load(x_ptr + row * x_stride + offs, mask=mask)
        tl.store(own + row * n_cols + offs, x, mask=mask)

    # Every thread's copies above happen before the raise (bar.sync, then a release at system
    # scope); the acquire below and the second bar.sync order the peers' rows before our reads.
    tl.debug_barrier()
    own_flags = tl.load(addr_ptr + WORLD + RANK).to(tl.pointer_type(tl.int32)) + pid * WORLD
    for q in tl.static_range(WORLD):
        if q != RANK:
            peer_flags = tl.load(addr_ptr + WORLD + q).to(tl.pointer_type(tl.int32)) + pid * WORLD
            _spin_cas(peer_flags + RANK, 0, 1, abort_ptr, "release", POLL)
    for q in tl.static_range(WORLD):
        if q != RANK:
            _spin_cas(own_flags + q, 1, 0, abort_ptr, "acquire", POLL)
    tl.debug_barrier()

    for i in range(pid, n_rows, num_programs):
        row = tl.cast(i, tl.int64)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for q in tl.static_range(WORLD):
            part = tl.load(addr_ptr + q).to(tl.pointer_type(dtype)) + half
            acc += tl.load(part + row * n_cols + offs, mask=mask, other=0.0).to(tl.float32)
        res = tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0).to(tl.float32)
        s = (acc.to(dtype).to(tl.float32) + res).to(dtype)
        tl.store(res_out_ptr + row * n_cols + offs, s, mask=mask)
        tl.store(y_ptr + row * n_cols + offs,
                 _rms_norm_row(s.to(tl.float32), w_ptr, offs, mask, n_cols, eps, dtype), mask=mask)


def all_reduce_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                        addresses: torch.Tensor, phase: torch.Tensor, max_rows: int, rank: int,
                        world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(s + residual) * weight, s + residual) with s = the sum over ranks of `x`.

    x, residual: [rows, hidden] with rows <= max_rows, last dim contiguous, same dtype as
    weight [hidden]. `addresses` (int64, on the device: every rank's staging buffer, every
    rank's flag pad, this rank's abort word) and `phase` (one int32 per program; sets the grid)
    are the symmetric-memory state described in the module docstring. Collective: every rank
    calls it with the same rows. Outputs are new contiguous tensors.
    """
    rows, hidden = x.shape
    if rows > max_rows:
        raise ValueError(f"{rows} rows exceed the staging buffer's {max_rows}")
    if residual.shape != x.shape or residual.dtype != x.dtype or weight.shape != (hidden,) or weight.dtype != x.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype}, residual {tuple(residual.shape)} {residual.dtype} and "
                         f"weight {tuple(weight.shape)} {weight.dtype} do not match")
    if x.stride(-1) != 1 or residual.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError("x and residual need a contiguous last dimension, weight a contiguous vector")
    y = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(y)
    block = triton.next_power_of_2(hidden)
    _all_reduce_rms_norm_kernel[(phase.numel(),)](
        x, x.stride(0), residual, residual.stride(0), weight, y, res_out, addresses, phase,
        rows, hidden, max_rows, float(eps),
        RANK=rank, WORLD=world_size, BLOCK=block, POLL=_ABORT_POLL_INTERVAL,
        num_warps=_num_warps(block), enable_fp_fusion=False,
    )
    return y, res_out


# ----------------------------------------------------------------------------- arrival count wait
# For the copy-engine exchange of prefill-sized partial sums (parallel/copy_engine.py):
# the peer's copy stream bumps a counter in this rank's memory after each chunk of rows it
# copied here, and this kernel holds the stream until the count is reached.


@triton.jit(do_not_specialize=["target"])
def _wait_count_kernel(count_ptr, target, addr_ptr, POLL: tl.constexpr):
    """Return once the int32 *count_ptr >= target (acquire, system scope: the rows copied before
    the count was written are visible to the kernels after this one), or once the abort word
    (host-mapped int32 at the address in addr_ptr[0]) is non-zero. One program."""
    abort_ptr = tl.load(addr_ptr).to(tl.pointer_type(tl.int32))
    seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="sys")
    spins = 0
    aborted = 0
    while (seen < target) & (aborted == 0):
        spins += 1
        if spins % POLL == 0:
            aborted = _abort_word(abort_ptr)
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="sys")


def wait_count(count: torch.Tensor, target: int, abort_address: torch.Tensor, poll: int = _ABORT_POLL_INTERVAL) -> None:
    """Hold the current stream until `count` (int32 [1], written by a peer) reaches `target`.
    `abort_address`: int64 [1] on the device, the address of a host-mapped int32 abort word
    that ends the wait early (a dead peer). Capturable; no host sync."""
    if count.dtype != torch.int32 or count.numel() != 1:
        raise ValueError(f"count must be one int32, got {count.dtype} x {count.numel()}")
    if not 0 <= target < 2**31:
        raise ValueError(f"target {target} is outside int32's range")
    _wait_count_kernel[(1,)](count, target, abort_address, POLL=poll, num_warps=1)
