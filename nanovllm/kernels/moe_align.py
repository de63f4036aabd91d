"""Token / expert alignment for the fused-MoE GEMMs (fused_moe.py): the T*k (token, choice) slots
grouped by expert, each group padded to a multiple of the GEMMs' row block, and the expert of
each row block. Built on the device with sizes fixed by (T, k, E), so CUDA graphs can capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_EXPERTS = 1024  # the alignment kernels hold a [chunk, next_pow2(E)] one-hot tile in registers


@triton.jit
def _chunk_onehot(ids_ptr, first, num_slots, num_experts, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    """Slots first..first+CHUNK-1: (slot numbers [CHUNK], their expert ids [CHUNK], int32
    one-hot [CHUNK, E_PAD] of the ids). Rows past num_slots (id -1) and ids outside
    [0, num_experts) have an all-zero row."""
    slots = first + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + slots, mask=slots < num_slots, other=-1).to(tl.int32)
    cols = tl.arange(0, E_PAD)
    hit = (ids[:, None] == cols[None, :]) & (cols[None, :] < num_experts)
    return slots, ids, hit.to(tl.int32)


@triton.jit
def _scatter_chunk(sorted_ptr, slots, ids, onehot, base, CHUNK: tl.constexpr):
    """sorted[base[e] + r] = slot for each slot of a chunk, e its expert and r the number of
    earlier slots of the chunk with the same expert (so slots keep their order inside an
    expert's group). base: [E_PAD] int32. Slots with an all-zero one-hot row are dropped.

    The rank is a [CHUNK, CHUNK] compare-and-count and the base a one-hot dot, both plain
    reductions: no scans and no register gathers, which keeps this cheap on the GPU."""
    i = tl.arange(0, CHUNK)
    earlier = (ids[None, :] == ids[:, None]) & (i[None, :] < i[:, None])
    rank = tl.sum(earlier.to(tl.int32), axis=1)
    dest = tl.sum(onehot * base[None, :], axis=1) + rank
    tl.store(sorted_ptr + dest, slots, mask=tl.sum(onehot, axis=1) > 0)


@triton.jit
def _write_layout(counts, sorted_ptr, block_expert_ptr, total_ptr, sentinel, max_blocks,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, ROWS: tl.constexpr):
    """From per-expert slot counts [E_PAD] (int32, 0 past the last expert): each expert's group
    padded to a multiple of BLOCK_M, groups laid out in expert order. Writes the sentinel into
    every padding position and every position past the last group (up to max_blocks * BLOCK_M),
    block_expert[b] for all max_blocks blocks (-1 past the last group), and the padded total to
    total_ptr[0]. Returns each expert's first position [E_PAD] (int32)."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(total_ptr, total)
    j = tl.arange(0, BLOCK_M)
    fill = tl.zeros([E_PAD, BLOCK_M], dtype=tl.int32) + sentinel
    tl.store(sorted_ptr + (starts + counts)[:, None] + j[None, :], fill, mask=j[None, :] < (padded - counts)[:, None])
    tail = tl.zeros([ROWS, BLOCK_M], dtype=tl.int32) + sentinel
    for b0 in range(0, max_blocks, ROWS):
        blk = b0 + tl.arange(0, ROWS)
        first = blk * BLOCK_M
        in_range = blk < max_blocks
        # The block's expert: how many groups end at or before its first position. Experts
        # without slots have empty groups and are never the answer.
        expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blk, tl.where(first < total, expert, -1), mask=in_range)
        tl.store(sorted_ptr + first[:, None] + j[None, :], tail, mask=(in_range & (first >= total))[:, None])
    return starts


@triton.jit
def _align_single_kernel(ids_ptr, sorted_ptr, block_expert_ptr, total_ptr, num_slots, num_experts, max_blocks,
                         BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr):
    """The whole alignment in one program (one launch: what small decode batches want).
    Pass 1 counts each expert's slots, `_write_layout` places the groups, pass 2 scatters the
    slots chunk by chunk, each chunk after the previous ones of the same expert."""
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for first in range(0, num_slots, CHUNK):
        slots, ids, onehot = _chunk_onehot(ids_ptr, first, num_slots, num_experts, CHUNK, E_PAD)
        counts += tl.sum(onehot, axis=0)
    base = _write_layout(counts, sorted_ptr, block_expert_ptr, total_ptr, num_slots, max_blocks, BLOCK_M, E_PAD, ROWS)
    for first in range(0, num_slots, CHUNK):
        slots, ids, onehot = _chunk_onehot(ids_ptr, first, num_slots, num_experts, CHUNK, E_PAD)
        _scatter_chunk(sorted_ptr, slots, ids, onehot, base, CHUNK)
        base += tl.sum(onehot, axis=0)


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, num_slots, num_experts, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    """Program c: counts[c, e] = number of slots of chunk c (CHUNK slots) routed to expert e."""
    c = tl.program_id(0)
    slots, ids, onehot = _chunk_onehot(ids_ptr, c * CHUNK, num_slots, num_experts, CHUNK, E_PAD)
    tl.store(counts_ptr + c * E_PAD + tl.arange(0, E_PAD), tl.sum(onehot, axis=0))


@triton.jit
def _align_layout_kernel(counts_ptr, sorted_ptr, block_expert_ptr, total_ptr, num_chunks, num_slots, max_blocks,
                         BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK_ROWS: tl.constexpr, ROWS: tl.constexpr):
    """One program. counts [num_chunks + 1, E_PAD]: rows 0..num_chunks-1 are turned in place
    into each chunk's offset inside its expert's group (an exclusive prefix sum over chunks,
    CHUNK_ROWS chunks per step); row num_chunks receives each expert's first position."""
    cols = tl.arange(0, E_PAD)
    running = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, num_chunks, CHUNK_ROWS):
        rows = c0 + tl.arange(0, CHUNK_ROWS)
        ptrs = counts_ptr + rows[:, None] * E_PAD + cols[None, :]
        ok = rows[:, None] < num_chunks
        cnt = tl.load(ptrs, mask=ok, other=0)
        tl.store(ptrs, tl.cumsum(cnt, axis=0) - cnt + running[None, :], mask=ok)
        running += tl.sum(cnt, axis=0)
    starts = _write_layout(running, sorted_ptr, block_expert_ptr, total_ptr, num_slots, max_blocks, BLOCK_M, E_PAD, ROWS)
    tl.store(counts_ptr + num_chunks * E_PAD + cols, starts)


@triton.jit
def _align_scatter_kernel(ids_ptr, counts_ptr, sorted_ptr, num_slots, num_experts, num_chunks,
                          CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    """Program c scatters the slots of chunk c to expert start + chunk offset + rank."""
    c = tl.program_id(0)
    cols = tl.arange(0, E_PAD)
    slots, ids, onehot = _chunk_onehot(ids_ptr, c * CHUNK, num_slots, num_experts, CHUNK, E_PAD)
    base = tl.load(counts_ptr + num_chunks * E_PAD + cols) + tl.load(counts_ptr + c * E_PAD + cols)
    _scatter_chunk(sorted_ptr, slots, ids, onehot, base, CHUNK)


# Up to this many chunks (decode batches) one program does the whole alignment: one launch
# instead of three inside the decode graph. Its loops are serial, so larger batches use the
# three-kernel version. (The cut-over is a guess, not a measurement.)
_SINGLE_PROGRAM_MAX_CHUNKS = 4


def max_padded_slots(num_slots: int, num_experts: int, block_m: int) -> int:
    """Upper bound (a multiple of block_m) of the padded slot count: every expert that gets a
    slot pads its group by at most block_m - 1, and at most min(E, T*k) experts get one."""
    bound = num_slots + min(num_experts, num_slots) * (block_m - 1)
    return bound // block_m * block_m


def align_tokens_to_experts(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the T*k slots by expert, each group padded to a multiple of block_m.

    topk_ids: [T, k] int32/int64 on any device (ids must lie in [0, num_experts): this is not
    checked, it would cost a host sync; a slot with an id outside is left out of every group).
    Slot s = t * k + j. Returns, all int32 on topk_ids' device, with sizes that depend on
    (T, k, E, block_m) only (no host sync: CUDA-graph capturable):
    - sorted_slot_ids [P], P = max_padded_slots(T*k, E, block_m): expert 0's slots in
      increasing order, padded with the sentinel T*k to a multiple of block_m, then expert 1's,
      ...; experts without slots take no room; every position past the last group is the
      sentinel too.
    - block_expert_ids [P // block_m]: the expert of each block of block_m positions, -1 for
      the blocks past the last group.
    - num_slots_padded [1]: the used length (sum of the padded groups).
    block_m: a power of two. num_experts <= 1024.
    """
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be a [tokens, top_k] tensor, got {getattr(topk_ids, 'shape', topk_ids)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or not 1 <= num_experts <= _MAX_EXPERTS:
        raise ValueError(f"num_experts must be an int in [1, {_MAX_EXPERTS}], got {num_experts!r}")
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m!r}")
    ids = topk_ids.contiguous()
    num_slots = ids.numel()
    if num_slots >= 2**31 - num_experts * block_m:
        raise ValueError(f"too many slots for int32 slot ids: {num_slots}")
    padded = max_padded_slots(num_slots, num_experts, block_m)
    max_blocks = padded // block_m
    dev = ids.device
    sorted_ids = torch.empty(padded, dtype=torch.int32, device=dev)
    block_experts = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    if num_slots == 0:
        total.zero_()
        return sorted_ids, block_experts, total
    e_pad = triton.next_power_of_2(num_experts)
    chunk = max(16, min(128, 16384 // e_pad))  # [chunk, e_pad] one-hot tiles of <= 16K elements
    rows = max(1, 8192 // max(e_pad, block_m))  # blocks per step of the block-expert loop
    num_chunks = triton.cdiv(num_slots, chunk)
    if num_chunks <= _SINGLE_PROGRAM_MAX_CHUNKS:
        _align_single_kernel[(1,)](ids, sorted_ids, block_experts, total, num_slots, num_experts, max_blocks,
                                   BLOCK_M=block_m, E_PAD=e_pad, CHUNK=chunk, ROWS=rows, num_warps=8)
        return sorted_ids, block_experts, total
    counts = torch.empty((num_chunks + 1, e_pad), dtype=torch.int32, device=dev)
    _align_count_kernel[(num_chunks,)](ids, counts, num_slots, num_experts, CHUNK=chunk, E_PAD=e_pad, num_warps=4)
    _align_layout_kernel[(1,)](counts, sorted_ids, block_experts, total, num_chunks, num_slots, max_blocks,
                               BLOCK_M=block_m, E_PAD=e_pad, CHUNK_ROWS=max(1, 4096 // e_pad), ROWS=rows, num_warps=8)
    _align_scatter_kernel[(num_chunks,)](ids, counts, sorted_ids, num_slots, num_experts, num_chunks,
                                         CHUNK=chunk, E_PAD=e_pad, num_warps=4)
    return sorted_ids, block_experts, total
