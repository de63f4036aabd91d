"""Batched LoRA products over adapter slots (the punica idea): every token's update through its
own slot's A and B, tokens of many adapters (and of none) in one launch.

The host sorts a step's tokens by slot and cuts each slot's run into tiles of BLOCK_M tokens
(`LoraTiles`); a program works on one tile, so it reads one slot's weights and never the others'.
The grid is sized by the token count alone (at most cdiv(T, BLOCK_M) + slots tiles; unused tiles
have no tokens and return at once), so both kernels replay inside CUDA graphs with the tiles of
each step written into the same buffers.

- `lora_shrink`: xa[t] = x[t] @ A[slot(t)]^T, A stacked [S, W, in] (W = parts * max rank), fp32.
  Split over the input dimension: a decode step has only a few tiles, and each would otherwise
  walk 4,096+ inputs alone; the splits add into xa (zeroed first).
- `lora_expand`: y[t] += xa[t] @ B[slot(t)]^T in place, B the columns [out, S * W] of each
  slot (block-diagonal over the packed parts; the zeros of other parts cost a few FLOPs, never
  a wrong sum). xa is rounded to y's dtype first, as the plain-torch product rounds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK_M = 16  # tokens of a tile (the smallest tl.dot M): decode steps spread tokens over slots
SHRINK_SPLIT = 256  # inputs per shrink program


@dataclass
class LoraTiles:
    """A step's tokens sorted by slot (`order`, int32 token indices) and their tiles (`table`
    rows: slot, first position in `order`, number of tokens; 0: unused). Device tensors, kept
    for the engine's life so that captured graphs read each step's tiles."""

    order: torch.Tensor
    table: torch.Tensor
    slots: int

    @classmethod
    def allocate(cls, max_tokens: int, slots: int, device) -> "LoraTiles":
        tiles = triton.cdiv(max_tokens, BLOCK_M) + slots
        return cls(torch.zeros(max_tokens, dtype=torch.int32, device=device),
                   torch.zeros(3, tiles, dtype=torch.int32, device=device), slots)

    def write(self, planned: torch.Tensor, num_order: int) -> None:
        """This step's plan, on the device: `order` (num_order values), then the table."""
        self.order[:num_order].copy_(planned[:num_order])
        self.table.copy_(planned[num_order:].view(3, -1))

    @staticmethod
    def plan(token_slots: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
        """(order, tiles [3, capacity]: slot / start / count rows, zero-padded) for tokens
        whose slots are `token_slots` (-1: no adapter)."""
        used = np.flatnonzero(token_slots >= 0)
        order = used[np.argsort(token_slots[used], kind="stable")].astype(np.int32)
        slots, counts = np.unique(token_slots[order], return_counts=True)
        first = np.cumsum(counts) - counts
        per_slot = -(-counts // BLOCK_M)
        within = np.arange(per_slot.sum()) - np.repeat(np.cumsum(per_slot) - per_slot, per_slot)
        start = np.repeat(first, per_slot) + within * BLOCK_M
        tiles = np.zeros((3, capacity), dtype=np.int32)
        n = len(start)
        tiles[0, :n], tiles[1, :n] = np.repeat(slots, per_slot), start
        tiles[2, :n] = np.minimum(BLOCK_M, np.repeat(first + counts, per_slot) - start)
        return order, tiles

    def grid(self, num_tokens: int) -> int:
        """Programs along the tiles for a step of `num_tokens` (any tiling of them fits)."""
        return min(self.table.shape[1], triton.cdiv(num_tokens, BLOCK_M) + self.slots)


@triton.jit
def _tile_tokens(order_ptr, tile_slot_ptr, tile_start_ptr, tile, count, BLOCK_M: tl.constexpr):
    """A tile's slot (int64), its row numbers 0..BLOCK_M and its tokens' indices (int64; 0 past
    `count`, masked by the caller)."""
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    m = tl.arange(0, BLOCK_M)
    tokens = tl.load(order_ptr + tl.load(tile_start_ptr + tile) + m, mask=m < count, other=0).to(tl.int64)
    return slot, m, tokens


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, xa_ptr, order_ptr, tile_slot_ptr, tile_start_ptr, tile_count_ptr,
                        stride_x, stride_as, stride_an, stride_xa, in_features, width,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    tile, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(tile_count_ptr + tile)
    if count == 0:
        return
    slot, m, tokens = _tile_tokens(order_ptr, tile_slot_ptr, tile_start_ptr, tile, count, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * SPLIT, tl.minimum(pid_k * SPLIT + SPLIT, in_features), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + tokens[:, None] * stride_x + k[None, :], mask=(m[:, None] < count) & (k[None, :] < in_features), other=0.0)
        a = tl.load(a_ptr + slot * stride_as + n[None, :] * stride_an + k[:, None],
                    mask=(n[None, :] < width) & (k[:, None] < in_features), other=0.0)
        acc += tl.dot(x, a, input_precision=PRECISION)
    tl.atomic_add(xa_ptr + tokens[:, None] * stride_xa + n[None, :], acc, mask=(m[:, None] < count) & (n[None, :] < width))


@triton.jit
def _lora_expand_kernel(xa_ptr, b_ptr, y_ptr, order_ptr, tile_slot_ptr, tile_start_ptr, tile_count_ptr,
                        stride_xa, stride_bn, stride_y, out_features, width,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr):
    tile, pid_n = tl.program_id(0), tl.program_id(1)
    count = tl.load(tile_count_ptr + tile)
    if count == 0:
        return
    slot, m, tokens = _tile_tokens(order_ptr, tile_slot_ptr, tile_start_ptr, tile, count, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, width, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xa = tl.load(xa_ptr + tokens[:, None] * stride_xa + k[None, :], mask=(m[:, None] < count) & (k[None, :] < width), other=0.0)
        b = tl.load(b_ptr + n[None, :] * stride_bn + slot * width + k[:, None],
                    mask=(n[None, :] < out_features) & (k[:, None] < width), other=0.0)
        acc += tl.dot(xa.to(y_ptr.dtype.element_ty), b, input_precision=PRECISION)
    mask = (m[:, None] < count) & (n[None, :] < out_features)
    ptrs = y_ptr + tokens[:, None] * stride_y + n[None, :]
    y = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, (y.to(tl.float32) + acc.to(y_ptr.dtype.element_ty).to(tl.float32)).to(y_ptr.dtype.element_ty), mask=mask)


def _precision(t: torch.Tensor) -> str:
    # fp32 models (the tests' references) multiply in full fp32, not TF32 (tl.dot's default)
    return "ieee" if t.dtype == torch.float32 else "tf32"


def lora_shrink(x: torch.Tensor, a: torch.Tensor, tiles: LoraTiles) -> torch.Tensor:
    """xa fp32 [T, W]: each token's x [T, in] times its slot's A^T (a: [S, W, in]); zero for
    tokens of no slot."""
    t, in_features = x.shape
    width = a.shape[1]
    xa = torch.zeros(t, width, dtype=torch.float32, device=x.device)
    block_n = max(16, min(64, triton.next_power_of_2(width)))
    grid = (tiles.grid(t), triton.cdiv(width, block_n), triton.cdiv(in_features, SHRINK_SPLIT))
    _lora_shrink_kernel[grid](x, a, xa, tiles.order, tiles.table[0], tiles.table[1], tiles.table[2],
                              x.stride(0), a.stride(0), a.stride(1), xa.stride(0), in_features, width,
                              BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=64, SPLIT=SHRINK_SPLIT,
                              PRECISION=_precision(x), num_warps=4)
    return xa


def lora_expand(xa: torch.Tensor, b: torch.Tensor, y: torch.Tensor, tiles: LoraTiles) -> None:
    """In place: y [T, out] += xa [T, W] (rounded to y's dtype) times each token's slot's B^T,
    b [out, S * W] holding slot s in columns s * W .. (s + 1) * W."""
    out_features, width = y.shape[1], xa.shape[1]
    if y.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("lora_expand needs y and b with contiguous rows")
    grid = (tiles.grid(y.shape[0]), triton.cdiv(out_features, 64))
    _lora_expand_kernel[grid](xa, b, y, tiles.order, tiles.table[0], tiles.table[1], tiles.table[2],
                              xa.stride(0), b.stride(0), y.stride(0), out_features, width,
                              BLOCK_M=BLOCK_M, BLOCK_N=64, BLOCK_K=16, PRECISION=_precision(y), num_warps=4)
