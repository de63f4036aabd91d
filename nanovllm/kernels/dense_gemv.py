"""Batch-1 GEMV for 16-bit and FP8 weights, with the kernel that makes its input folded in.

out[N] = x[K] @ W[N, K]^T (* scale) (+ bias) for one row x, W row-major (nn.Linear's layout), in
bf16 / fp16 or float8_e4m3fn with one fp32 scale (online FP8's per-tensor weights) or fp32 scales
per 128 x 128 block (Qwen's FP8 checkpoints: a program's rows lie in one block row, so the block
scales multiply x, BLOCK_K values a step, not every weight).

Why it pays at batch 1 (profiled on the H200, BENCHMARKS.md "Batch-1 steps"): a decode step
reads every weight once, yet cuBLAS's small-M GEMMs take ~5 us however small the matrix (0.6B's
8 MB qkv: 2 us of bytes), and the kernels around them (RMSNorm, SiLU * up, FP8's activation
amax + cast) add a launch and ~1.5-2.6 us each, 3-7 of them a layer. Here:
- No activation quantization: FP8 codes become floats in registers and multiply bf16 x in fp32;
  the scale is applied once per output.
- SiLU * up folded into gate_up's epilogue (`silu_mul`: each program owns rows of gate and the
  same rows of up, x loaded once), so its kernel goes away; rounded as the separate kernel
  rounds (fused_ops.silu_mul_rounded), so the values are those of the unfused path. Measured
  against the alternative, down_proj's prologue (recomputed by every program), below.
- Optionally an RMSNorm prologue (`Prologue.RMS_NORM`, with the residual add; each program sums
  the row's squares itself, program 0 stores the new residual): measured, not wired in (below);
  or the norm split between its neighbours: the GEMV before adds the residual to its output and
  writes that stream times the norm's weight and each program's sum of squares of the stream
  (`add_residual`, `next_norm_weight`); `Prologue.NORM_PARTS` multiplies that product and scales
  each output by the rsqrt made from those sums. No per-element work is added to either GEMV, so
  the fold serves any size (an earlier prologue that normed x in every program cost more than
  the kernel it saved above ~16 MB); one kernel fewer than GEMV + add_rms_norm + GEMV, and with
  `silu_mul` gate_up normed and gated in one. model/norm_chain.py runs a batch-1 forward on these
  (bench_dense_gemv.py times the chains).
- Each program owns BLOCK_N rows of W and runs all of K: no split-K, no atomics, no zeroing.
  A thread's loads are 16 bytes along K; the [BLOCK_N, BLOCK_K] products accumulate in fp32
  registers and are summed across the tile once at the end.
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fused_ops import check_norm_fold, inv_rms_parts, silu_mul_rounded, store_residual_sum

# A prologue is recomputed by every program, so it pays on small weights only. Measured on the
# H200 (bench_dense_gemv.py, BENCHMARKS.md "Batch-1 steps"): an RMSNorm prologue won on 0.6B's
# qkv (5.7 against 6.79 us) and lost on gate_up (9.6 against 7.84). SiLU * up as down_proj's
# prologue lost on 8B (33.7 against 31.5 us) and, once the weights' loads came first in the loop,
# on 0.6B too: gate_up's epilogue made the engine's batch-1 step 0.4% and 1.7% faster in two
# A/B runs (1.055 / 1.044 against 1.059 / 1.062 ms, H100, 2026-12-05), so that prologue is gone.


class Prologue(IntEnum):
    PLAIN = 0  # x as given
    RMS_NORM = 1  # x = norm(a (+ residual)) * norm weight
    NORM_PARTS = 2  # x = the stream times the norm weight and the stream's sums of squares, from the GEMV
    # before (`add_residual` with `next_norm_weight`); the outputs are scaled by rsqrt(mean + eps)


class Tile(NamedTuple):
    block_n: int = 8  # output rows per program
    block_k: int = 512  # K values per step
    warps: int = 4


@triton.jit
def _ld(ptr, mask, EVEN: tl.constexpr):
    """A load, masked unless EVEN (K a multiple of the tile: no per-element predicate)."""
    if EVEN:
        return tl.load(ptr)
    return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def _residual_sum(a_ptr, r_ptr, k, mask, HAS_RESIDUAL: tl.constexpr, EVEN: tl.constexpr, dtype: tl.constexpr):
    """a (+ residual, the sum rounded to the dtype as torch adds) in fp32."""
    s = _ld(a_ptr + k, mask, EVEN).to(tl.float32)
    if HAS_RESIDUAL:
        s = (s + _ld(r_ptr + k, mask, EVEN).to(tl.float32)).to(dtype).to(tl.float32)
    return s


@triton.jit
def _inv_rms(a_ptr, r_ptr, res_out_ptr, K, eps, first, HAS_RESIDUAL: tl.constexpr, BLOCK_K: tl.constexpr,
             dtype: tl.constexpr):
    """rsqrt(mean(s^2) + eps) of the whole row s; program 0 (`first`) stores s as the new residual."""
    offs = tl.arange(0, BLOCK_K)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs
        mask = k < K
        s = _residual_sum(a_ptr, r_ptr, k, mask, HAS_RESIDUAL, False, dtype)
        sq += s * s
        if HAS_RESIDUAL:
            tl.store(res_out_ptr + k, s.to(dtype), mask=k < tl.where(first, K, 0))
    return tl.rsqrt(tl.sum(sq, axis=0) / K + eps)


@triton.jit
def _input(a_ptr, r_ptr, nw_ptr, k, mask, inv, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
           EVEN: tl.constexpr, dtype: tl.constexpr):
    """x[k] in fp32, made by the prologue (see Prologue; NORM_PARTS takes x as given)."""
    if PROLOGUE == 1:
        s = _residual_sum(a_ptr, r_ptr, k, mask, HAS_RESIDUAL, EVEN, dtype)
        normed = (s * inv).to(dtype).to(tl.float32)
        w = _ld(nw_ptr + k, mask, EVEN).to(tl.float32)
        x = (normed * w).to(dtype).to(tl.float32)  # fused_ops._rms_norm_row's two roundings
    else:
        x = _ld(a_ptr + k, mask, EVEN).to(tl.float32)
    return x


@triton.jit
def _rows_w(w_rows, row_mask, k, K, EVEN_K: tl.constexpr):
    """This step's weights W[rows, k] ([rows, BLOCK_K], as stored)."""
    if EVEN_K:
        return tl.load(w_rows + k[None, :], mask=row_mask[:, None], other=0.0)
    return tl.load(w_rows + k[None, :], mask=row_mask[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def _rows_dot(w, x, k, K, scale_ptr, block_row, SCALE: tl.constexpr):
    """This step's products w * x[k] ([rows, BLOCK_K], fp32); with block scales (SCALE 2) x is
    first scaled by the rows' block row (`block_row`: they lie in one)."""
    if SCALE == 2:
        x = x * tl.load(scale_ptr + block_row * tl.cdiv(K, 128) + k // 128, mask=k < K, other=0.0)
    return w.to(tl.float32) * x[None, :]


@triton.jit
def _rows_out(acc, rows, row_mask, scale_ptr, bias_ptr, inv, SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The rows' sums (* the tensor scale) * inv (NORM_PARTS's norm, else 1) (+ bias), fp32."""
    y = tl.sum(acc, axis=1)
    if SCALE == 1:
        y = y * tl.load(scale_ptr)
    y = y * inv
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    return y


@triton.jit
def dense_gemv_kernel(w_ptr, a_ptr, r_ptr, nw_ptr, res_out_ptr, scale_ptr, bias_ptr, out_ptr, ss_ptr, scaled_ptr, N,
                      K, half, parts, eps, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SCALE: tl.constexpr,
                      HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
                      NORM_OUT: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """BLOCK_N outputs of out = x @ W^T over all of K; x made by PROLOGUE from a (, residual, norm
    weight). SCALE 0: none, 1: one fp32 scale, 2: [cdiv(N, 128), cdiv(K, 128)] block scales.
    GATED: rows r (gate) and half + r (up) of W give out[r] = silu(gate) * up (N = half).
    ADD_RESIDUAL: out = that + residual (r), ss[program] its sum of squares and with NORM_OUT
    scaled = out * the next norm's weight (nw, over N): what NORM_PARTS takes (x, ss)."""
    pid = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    offs = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    inv = 1.0
    if PROLOGUE == 1:
        inv = _inv_rms(a_ptr, r_ptr, res_out_ptr, K, eps, pid == 0, HAS_RESIDUAL, BLOCK_K, dtype)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N if GATED else 1, BLOCK_K], dtype=tl.float32)
    up_rows = w_ptr + (rows + half).to(tl.int64)[:, None] * K
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs
        # The weights' loads first, so their DRAM latency overlaps the making of x: issued after
        # it they waited for it, ~1 us a GEMV (H100, 2026-12-05: 0.6B's 112 GEMVs 516 -> 625 us).
        w = _rows_w(w_rows, row_mask, k, K, EVEN_K)
        if GATED:  # the same rows of up, x loaded once
            w_up = _rows_w(up_rows, row_mask, k, K, EVEN_K)
        x = _input(a_ptr, r_ptr, nw_ptr, k, k < K, inv, PROLOGUE, HAS_RESIDUAL, EVEN_K, dtype)
        acc += _rows_dot(w, x, k, K, scale_ptr, pid * BLOCK_N // 128, SCALE)
        if GATED:
            acc_up += _rows_dot(w_up, x, k, K, scale_ptr, (half + pid * BLOCK_N) // 128, SCALE)
    # RMS_NORM scaled x; NORM_PARTS scales the outputs, its sums read only now: read before the loop,
    # their load and reduction (a barrier) held back every weight load (H100: 0.6B's step -1.1%).
    out_scale = 1.0
    if PROLOGUE == 2:
        out_scale = inv_rms_parts(ss_ptr, parts, K, eps)
    y = _rows_out(acc, rows, row_mask, scale_ptr, bias_ptr, out_scale, SCALE, HAS_BIAS)
    if GATED:  # each rounded to the dtype first, as gate_up's own output would be
        up = _rows_out(acc_up, half + rows, row_mask, scale_ptr, bias_ptr, out_scale, SCALE, HAS_BIAS)
        tl.store(out_ptr + rows, silu_mul_rounded(y.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype),
                 mask=row_mask)
    elif ADD_RESIDUAL:
        store_residual_sum(out_ptr, ss_ptr, y, r_ptr, rows, row_mask, nw_ptr, scaled_ptr, NORM_OUT, dtype)
    else:
        tl.store(out_ptr + rows, y.to(dtype), mask=row_mask)


def choose(n: int, k: int, weight_dtype: torch.dtype) -> Tile:
    """The tile of an [n, k] weight, from a sweep on the H200 (benchmarks/kernels/bench_dense_gemv.py
    --sweep, Qwen3-0.6B's and 8B's GEMMs; within ~5% of each one's best). 16-byte loads along K."""
    if weight_dtype == torch.float8_e4m3fn:
        return Tile(4, min(1024, triton.next_power_of_2(k)), 4)
    if k > n:  # o_proj, down_proj: few rows, long ones
        return Tile(4 if n < 2048 else 16, min(1024, triton.next_power_of_2(k)), 8)
    return Tile(8 if n < 16384 else 16, min(512, triton.next_power_of_2(k)), 4)


def _check(x: torch.Tensor, weight: torch.Tensor, k: int) -> None:
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"dense_gemv takes one row of x [1, K], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be bf16 / fp16, got {x.dtype}")
    if weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [N, {k}], got {tuple(weight.shape)}")
    if weight.dtype not in (x.dtype, torch.float8_e4m3fn):
        raise ValueError(f"weight dtype {weight.dtype}: expected {x.dtype} or float8_e4m3fn")
    if k == 0:
        raise ValueError("x has no columns")


def _check_scale(weight: torch.Tensor, scale: torch.Tensor | None, k: int, tile: Tile, half: int) -> int:
    """The kernel's SCALE for these operands (0 none, 1 tensor, 2 block), or a ValueError."""
    if (weight.dtype == torch.float8_e4m3fn) != (scale is not None):
        raise ValueError("FP8 weights need their scale (and 16-bit weights take none)")
    blocks = (triton.cdiv(weight.shape[0], 128), triton.cdiv(k, 128))
    if scale is not None and tuple(scale.shape) not in ((1,), blocks):
        raise ValueError(f"scale must be [1] or {list(blocks)} (128 x 128 blocks), got {tuple(scale.shape)}")
    scaling = 0 if scale is None else 1 if scale.dim() == 1 else 2
    if scaling == 2 and (128 % tile.block_n or half % 128):
        raise ValueError(f"block scales need BLOCK_N dividing 128 (got {tile.block_n}) and, with silu_mul, "
                         f"gate and up on block boundaries (half {half})")
    return scaling


def _check_folds(k: int, n: int, weight: torch.Tensor, silu_mul: bool, prologue: Prologue, norm_weight,
                 add_residual, norm_parts, next_norm_weight) -> None:
    """ValueErrors for folds that do not fit these operands or one another."""
    if silu_mul and (weight.shape[0] % 2 or prologue == Prologue.RMS_NORM or add_residual is not None):
        raise ValueError(f"silu_mul needs gate and up rows ([2I, K], got {tuple(weight.shape)}), no RMS_NORM "
                         f"prologue, no add_residual")
    if (prologue == Prologue.RMS_NORM) != (norm_weight is not None and norm_weight.shape == (k,)):
        raise ValueError(f"RMS_NORM needs norm_weight [{k}] (and only it takes one)")
    if (prologue == Prologue.NORM_PARTS) != (norm_parts is not None):
        raise ValueError("NORM_PARTS takes norm_parts, the fp32 [programs] sums add_residual returned (and only it)")
    if add_residual is not None and prologue != Prologue.PLAIN:
        raise ValueError("add_residual takes x as given (prologue PLAIN)")
    check_norm_fold(n, add_residual, next_norm_weight, norm_parts)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, *, scale: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, silu_mul: bool = False, prologue: Prologue = Prologue.PLAIN,
               residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
               eps: float = 1e-6, tile: Tile | None = None, add_residual: torch.Tensor | None = None,
               norm_parts: torch.Tensor | None = None, next_norm_weight: torch.Tensor | None = None):
    """x [1, K] @ weight^T [N, K] (* scale) (+ bias [N]): [1, N]. FP8 weights take their fp32
    scale: one value [1], or [cdiv(N, 128), cdiv(K, 128)] for 128 x 128 blocks.

    silu_mul: the weight packs gate and up ([2I, K], gate_up_proj's); the result is silu(gate) *
    up [1, I] (`tile.block_n`: rows of each a program). prologue RMS_NORM: x (+ residual [1, K]) is
    normed with `norm_weight` [K] and `eps` first; with a residual the result is (out, x + residual).
    add_residual [1, N]: the result is (s = out + add_residual, each program's fp32 sum of s^2,
    s * next_norm_weight [N] or None). Prologue NORM_PARTS takes that product as x and those sums
    as `norm_parts`: its outputs are those of the norm of s, up to the norm's rounding of s * rsqrt
    (applied to the sums here instead), without a norm kernel or a per-element prologue.
    """
    k = x.shape[-1]
    _check(x, weight, k)
    # Triton specializes on 16-byte alignment: an unaligned view gets an aligned copy, so the launch
    # keeps the variant compiled at start-up instead of compiling a slower one inside a step.
    x = x.contiguous() if x.data_ptr() % 16 == 0 else x.clone(memory_format=torch.contiguous_format)
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    _check_folds(k, n, weight, silu_mul, prologue, norm_weight, add_residual, norm_parts, next_norm_weight)
    if tile is None:
        tile = choose(weight.shape[0], k, weight.dtype)
        tile = tile._replace(block_n=max(1, tile.block_n // 2)) if silu_mul else tile  # the same program count
    scaling = _check_scale(weight, scale, k, tile, n if silu_mul else 0)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    programs = triton.cdiv(n, tile.block_n)
    parts = torch.empty(programs, dtype=torch.float32, device=x.device) if add_residual is not None else norm_parts
    r = residual if residual is not None else add_residual
    nw = norm_weight if norm_weight is not None else next_norm_weight
    scaled = torch.empty_like(out) if next_norm_weight is not None else None
    dense_gemv_kernel[(programs,)](
        weight, x, r if r is not None else x, nw if nw is not None else x,
        res_out if res_out is not None else out, scale if scale is not None else out,
        bias if bias is not None else out, out, parts if parts is not None else out,
        scaled if scaled is not None else out, n, k, n, parts.numel() if parts is not None else 0, float(eps),
        PROLOGUE=int(prologue), HAS_RESIDUAL=residual is not None, SCALE=scaling, HAS_BIAS=bias is not None,
        GATED=silu_mul, ADD_RESIDUAL=add_residual is not None, NORM_OUT=scaled is not None,
        EVEN_K=k % tile.block_k == 0, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, num_warps=tile.warps)
    if add_residual is not None:
        return out, parts, scaled
    return out if res_out is None else (out, res_out)
