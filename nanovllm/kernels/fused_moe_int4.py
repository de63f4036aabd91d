"""The fused-MoE GEMMs (fused_moe.py) with INT4 experts: the same slots, alignment and epilogues,
with each expert's weight read as 4-bit words and dequantized in registers (w4a16.py's
arithmetic: a nibble OR-ed into 128.0's bits is 128 + q, and one exact FMA gives (q - z) * s).

Layout (features/quantization/int4_moe.py stacks it from GPTQ / AWQ / compressed-tensors
experts): per stack, qweight int32 [E, K / 8, N] (eight K-rows a word in int4_formats.py's fragment order),
scales and zeros [E, K / group, N] in the activations' dtype, optional perm int32 [E, K] (an
act-order expert's input features in group order: the kernel gathers the activation columns
through it). w13 has N = 2n columns (gate 0..n-1, up n..2n-1), w2 has K = n and N = H.

Each program takes one BLOCK_M block of slots of one expert and BLOCK_N output columns; a K-tile
lies in one group (BLOCK_K divides the group), so it needs one scale and zero row. Decode's
blocks are mostly padding (a slot or two per expert): the kernel is bound by the weights' bytes,
a quarter of the 16-bit kernel's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.moe_align import align_tokens_to_experts
from nanovllm.kernels.w4a16 import can_run
from nanovllm.kernels.w4a16_mma import float_128, fragment_word_and_shift


class Int4Stack(NamedTuple):
    """One stacked INT4 expert weight (module docstring)."""

    qweight: torch.Tensor  # int32 [E, K / 8, N]
    scales: torch.Tensor  # [E, K / group, N]
    zeros: torch.Tensor  # [E, K / group, N]
    group_size: int
    perm: torch.Tensor | None  # int32 [E, K], or None when every expert's features are in order


@triton.jit
def _tile_step(qw_ptr, s_ptr, z_ptr, N, K, k0, offs_k, offs_n, mask_n, GROUP: tl.constexpr):
    """One K-tile's words [BLOCK_K, BLOCK_N] (several K-rows read each word, from L1; row k's value
    is the nibble fragment_word_and_shift gives) with the bit offset of each row's nibble, the
    tile's scale row s and (128 + z) * s (the tile lies in one group)."""
    in_k = (k0 + offs_k) < K
    word, shift = fragment_word_and_shift(k0 + offs_k)
    words = tl.load(qw_ptr + word[:, None] * N + offs_n[None, :], mask=in_k[:, None] & mask_n[None, :], other=0)
    g = tl.minimum(k0, K - 1) // GROUP  # (a prefetch past the end reads the last group, unused)
    s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    c = (tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :] + 128.0) * s
    return words, shift[:, None], s, c


@triton.jit
def _dequantized_tile(qw, s_ptr, z_ptr, NT, K, k0, offs_k, offs_n, col_ok, GROUP: tl.constexpr):
    words, shift, s, c = _tile_step(qw, s_ptr, z_ptr, NT, K, k0, offs_k, offs_n, col_ok, GROUP)
    q = float_128(((words >> shift) & 0xF) << 16)
    return tl.fma(q, s, -c)


@triton.jit
def _moe_int4_kernel(a_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, c_ptr, weight_ptr, sorted_slot_ptr, block_expert_ptr,
                     N, K, num_slots, stride_am, stride_cm,
                     SLOTS_PER_A_ROW: tl.constexpr, GATE_UP: tl.constexpr, PERM: tl.constexpr,
                     GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[s, n] = sum_k A[s // SLOTS_PER_A_ROW, k] * W_e[k, n] for the block's slots s (expert e);
    GATE_UP: silu(gate) * up (columns n and N + n of a 2N-column stack); else times weight[s]."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // num_pid_n, pid % num_pid_n
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    slots = tl.load(sorted_slot_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = slots < num_slots
    a_rows = (slots // SLOTS_PER_A_ROW).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    NT = 2 * N if GATE_UP else N  # the stored matrix's columns
    qw = qw_ptr + expert * (K // 8) * NT
    sz = expert * (K // GROUP) * NT
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if PERM:
            cols = tl.load(perm_ptr + expert * K + k0 + offs_k).to(tl.int64)
        else:
            cols = k0 + offs_k
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + cols[None, :], mask=row_ok[:, None], other=0.0)
        w = _dequantized_tile(qw, s_ptr + sz, z_ptr + sz, NT, K, k0, offs_k, offs_n, col_ok, GROUP)
        acc = tl.dot(a, w.to(a.dtype), acc)
        if GATE_UP:
            w_up = _dequantized_tile(qw, s_ptr + sz, z_ptr + sz, NT, K, k0, offs_k, offs_n + N, col_ok, GROUP)
            acc_up = tl.dot(a, w_up.to(a.dtype), acc_up)
    if GATE_UP:
        out = acc * tl.sigmoid(acc) * acc_up
    else:
        out = acc * tl.load(weight_ptr + slots, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + slots[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


class Int4MoeConfig(NamedTuple):
    block_m: int
    block_n: int
    warps: int
    stages: int


def choose(num_tokens: int, top_k: int, num_experts: int) -> Int4MoeConfig:
    """By the mean slots per expert, as fused_moe.get_config: decode streams the weights from
    one mostly padded 16-row block per expert (narrow column tiles keep every SM loading); more
    rows per expert take taller blocks, so fewer programs read each expert's words."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    if per_expert <= 4:
        return Int4MoeConfig(16, 32, 4, 3)
    if per_expert <= 32:
        return Int4MoeConfig(32, 64, 4, 3)
    return Int4MoeConfig(64, 64, 4, 3)


def _block_k(group: int) -> int:
    b = 128
    while group % b:
        b //= 2
    return b


def _gemm(a, w: Int4Stack, out, weights, sorted_ids, block_ids, n: int, num_slots: int, per_row: int,
          gate_up: bool, cfg: Int4MoeConfig) -> None:
    k = w.qweight.shape[1] * 8
    grid = (block_ids.numel() * triton.cdiv(n, cfg.block_n),)
    perm = w.perm if w.perm is not None else sorted_ids  # (unused pointer without PERM)
    _moe_int4_kernel[grid](a, w.qweight, w.scales, w.zeros, perm, out, weights, sorted_ids, block_ids,
                           n, k, num_slots, a.stride(0), out.stride(0), SLOTS_PER_A_ROW=per_row, GATE_UP=gate_up,
                           PERM=w.perm is not None, GROUP=w.group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                           BLOCK_K=_block_k(w.group_size), num_warps=cfg.warps, num_stages=cfg.stages)


def _check(hidden: torch.Tensor, w13: Int4Stack, w2: Int4Stack, topk_ids: torch.Tensor) -> None:
    e, h8, two_n = w13.qweight.shape
    n = two_n // 2
    want = {"w13": ((e, h8, two_n), h8 * 8), "w2": ((e, n // 8, hidden.shape[1]), n)}
    for name, stack in (("w13", w13), ("w2", w2)):
        shape, k = want[name]
        if tuple(stack.qweight.shape) != shape or not can_run(k, stack.group_size):
            raise ValueError(f"fused_moe_int4: {name} qweight {tuple(stack.qweight.shape)} (group "
                             f"{stack.group_size}) does not fit hidden {tuple(hidden.shape)} and w13 "
                             f"{tuple(w13.qweight.shape)}")
        groups = (e, k // stack.group_size, shape[2])
        if tuple(stack.scales.shape) != groups or tuple(stack.zeros.shape) != groups:
            raise ValueError(f"fused_moe_int4: {name} scales / zeros must be {groups}")
        if stack.perm is not None and tuple(stack.perm.shape) != (e, k):
            raise ValueError(f"fused_moe_int4: {name} perm must be {(e, k)}")
    if hidden.shape[1] != h8 * 8 or topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"fused_moe_int4: hidden {tuple(hidden.shape)}, topk_ids {tuple(topk_ids.shape)}")


def fused_moe_int4(hidden: torch.Tensor, w13: Int4Stack, w2: Int4Stack, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, config: Int4MoeConfig | None = None) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = topk_ids[t, j],
    with INT4 experts (module docstring). hidden [T, H] fp16 / bf16 (fp32 under the
    interpreter); topk_weights [T, k] float, topk_ids [T, k] ints in [0, E) (not checked: a host
    sync). Each slot's output is rounded to hidden's dtype, then a token's k are summed in fp32,
    as fused_moe does. No host syncs: capturable in a CUDA graph."""
    _check(hidden, w13, w2, topk_ids)
    t, top_k = topk_ids.shape
    n, hidden_size = w13.qweight.shape[2] // 2, hidden.shape[1]
    if t == 0:
        return torch.empty(0, hidden_size, dtype=hidden.dtype, device=hidden.device)
    cfg = config or choose(t, top_k, w13.qweight.shape[0])
    sorted_ids, block_ids, _ = align_tokens_to_experts(topk_ids, w13.qweight.shape[0], cfg.block_m)
    x = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    inter = torch.empty(t * top_k, n, dtype=hidden.dtype, device=hidden.device)
    _gemm(x, w13, inter, inter, sorted_ids, block_ids, n, t * top_k, top_k, True, cfg)
    slot_out = torch.empty(t * top_k, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _gemm(inter, w2, slot_out, topk_weights.contiguous(), sorted_ids, block_ids, hidden_size, t * top_k, 1, False,
          cfg)
    return slot_out if top_k == 1 else slot_out.view(t, top_k, hidden_size).sum(dim=1)
