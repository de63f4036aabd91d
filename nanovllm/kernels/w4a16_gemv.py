"""W4A16 GEMV for one row of x (batch-1 decode): out[N] = x[K] @ W[K, N], the layout of
features/quantization/int4_formats.py (qweight [K / 8, N], each block of 32 K-rows in fragment
order: nibble j = 4c + 2a + b of word t is row 16a + 8b + 2t + c; scales s and zero points z
[K / group, N]: W[k, n] = (q[k, n] - z) * s).

A decode step at batch 1 reads every weight once, so this kernel must keep the memory busy with
few instructions a weight: the H200 moves ~8.6e12 four-bit weights a second and issues ~3.3e13
thread instructions (integer ones at half that), ~3.9 a weight in all. Read from SASS (sm90,
specialized as a launch is), this kernel's loop spends ~3.4 (3.9 with masked scalar loads of x;
kernels/w4a16.py's earlier GEMV ~6). Yet the GEMVs run at 45-67% of the bandwidth: cutting 13%
of the instructions made them 2-4% faster (H100), so they wait mostly on memory latency:
- Strips: each thread owns 4 consecutive word rows (32 K-rows: one fragment block, one group, a
  single scale and zero point) of 4 adjacent columns, loaded as 128-bit vectors; the 4 rows are
  4 tiles of one layout, so their sum is register arithmetic, and x's 32 values serve 4 columns
  (paired with each word's nibbles in the fragment order by naming registers, not moving them).
- Nibbles as floats without conversions: two masks split a word into its even and odd nibbles,
  one per byte; `prmt` builds the float 128 + q from a byte under 128.0's exponent byte (1.25
  integer instructions a weight), then one FMA with x. The 128 and the zero point come off once
  per strip and column: sum x (q - z) = sum x (128 + q) - (128 + z) sum x, then times the scale.
  The fp32 sums lose nothing a 16-bit output can see (the offset costs 7 of fp32's 24 bits).
- x read as int32 pairs of bf16, a 16-byte vector a thread a word row: each value's bits moved
  to the top of an fp32 are that value.
- Bytes in flight: the source loads the next strip's words before this strip's arithmetic,
  but ptxas sinks those loads to the loop's bottom and loads scales and zero points after the
  arithmetic (SASS, 63 registers), so each step waits about two DRAM latencies; 16-32 columns a
  program give each SM a few programs, each running all of K. Forcing the order (volatile
  loads) and an L2 prefetch of each program's slice were both slower (BENCHMARKS.md).
- gate_up's SiLU * up in the epilogue (`silu_mul`): a program's columns are half gate, half the
  same columns of up, so it writes silu(gate) * up and the separate kernel goes away.
Measured on the H200 and dropped (BENCHMARKS.md): Triton's cp.async pipelining of the strips,
8 columns a thread (fewer instructions, fewer programs: slower), split-K, and PDL launches.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fused_ops import check_norm_fold, inv_rms_parts, silu_mul_rounded, store_residual_sum
from nanovllm.kernels.w4a16_mma import INTERPRETED, nibble_128


class Strips(NamedTuple):
    block_n: int = 16  # columns per program
    warps: int = 8


class Int4Operands(NamedTuple):
    """What a quantization method offers model/norm_chain.py for one projection's batch-1 GEMV
    (its `gemv_operands`): the kernel layout's tensors, the permutation of x's columns under
    act-order (or None) and the launch."""
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    perm: torch.Tensor | None
    cfg: Strips


# Eight nibbles of a word as the floats 128 + q: two masks split the word into its even and odd
# nibbles, one per byte; `prmt` then builds each float from one of those bytes at bits 16..23
# (its high nibble zero) under 128.0's exponent byte 0x43 (the register `m`).
_NIBBLES = tl.constexpr("""{
.reg .b32 lo, hi, m;
mov.b32 m, 0x43000000;
and.b32 lo, $8, 0x0F0F0F0F;
shr.u32 hi, $8, 4;
and.b32 hi, hi, 0x0F0F0F0F;
prmt.b32 $0, lo, m, 0x7054;
prmt.b32 $1, hi, m, 0x7054;
prmt.b32 $2, lo, m, 0x7154;
prmt.b32 $3, hi, m, 0x7154;
prmt.b32 $4, lo, m, 0x7254;
prmt.b32 $5, hi, m, 0x7254;
prmt.b32 $6, lo, m, 0x7354;
prmt.b32 $7, hi, m, 0x7354;
}""")


@triton.jit
def _floats_128(words, ASM: tl.constexpr):
    """The eight nibbles of each word as 128 + q (fp32): inline PTX, or shifts (the interpreter)."""
    if ASM:
        return tl.inline_asm_elementwise(_NIBBLES, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words], dtype=(tl.float32,) * 8,
                                         is_pure=True, pack=1)
    return (nibble_128(words, 0), nibble_128(words, 1), nibble_128(words, 2), nibble_128(words, 3),
            nibble_128(words, 4), nibble_128(words, 5), nibble_128(words, 6), nibble_128(words, 7))


@triton.jit
def _x_values(xw_ptr, rows, n_words, BLOCK_N: tl.constexpr, EVEN: tl.constexpr):
    """x's eight bf16 values of word row `rows` [P, 1] as fp32, each [P, BLOCK_N / 4] (one a
    thread). x is read as int32 pairs, one 16-byte vector a thread: element c of the [P, BLOCK_N]
    load is pair c % 4, so a thread's four columns hold the row's four pairs and the reshape and
    splits below stay in its registers. A pair's bits moved to the top of an fp32 are each value
    exactly (a shift or a mask, no conversion). EVEN: no row past K's end, so no mask (its
    zeroing and 64-bit compares were ~10% of the loop's instructions)."""
    offs = rows * 4 + (tl.arange(0, BLOCK_N) % 4)[None, :]
    if EVEN:
        v = tl.load(xw_ptr + offs)
    else:
        v = tl.load(xw_ptr + offs, mask=rows < n_words, other=0)
    even, odd = tl.split(tl.reshape(v, (v.shape[0], BLOCK_N // 4, 2, 2)))  # pairs 0, 2 and 1, 3
    p0, p2 = tl.split(even)
    p1, p3 = tl.split(odd)
    return ((p0 << 16).to(tl.float32, bitcast=True), (p0 & -65536).to(tl.float32, bitcast=True),
            (p1 << 16).to(tl.float32, bitcast=True), (p1 & -65536).to(tl.float32, bitcast=True),
            (p2 << 16).to(tl.float32, bitcast=True), (p2 & -65536).to(tl.float32, bitcast=True),
            (p3 << 16).to(tl.float32, bitcast=True), (p3 & -65536).to(tl.float32, bitcast=True))


@triton.jit
def _spread(e, BLOCK_N: tl.constexpr):
    """[P, BLOCK_N / 4] -> [P, BLOCK_N]: each value over its thread's four columns."""
    return tl.reshape(tl.broadcast_to(e[:, :, None], (e.shape[0], BLOCK_N // 4, 4)), (e.shape[0], BLOCK_N))


@triton.jit
def _words(qw_ptr, rows, n2, N, n_words, EVEN: tl.constexpr):
    """Word row `rows` [P, 1] of columns n2 [1, BLOCK_N] (a row past the end reads the last one)."""
    if EVEN:
        return tl.load(qw_ptr + tl.minimum(rows, n_words - 1) * N + n2)
    return tl.load(qw_ptr + tl.minimum(rows, n_words - 1) * N + n2, mask=n2 < N, other=0)


@triton.jit
def _word(words, x0, x1, x2, x3, x4, x5, x6, x7, part, xsum, BLOCK_N: tl.constexpr, ASM: tl.constexpr):
    """part += a word's eight (128 + q) times x_j, the value of nibble j's K-row; xsum ([P,
    BLOCK_N / 4]) += those values."""
    f0, f1, f2, f3, f4, f5, f6, f7 = _floats_128(words, ASM)
    part = tl.fma(f0, _spread(x0, BLOCK_N), tl.fma(f1, _spread(x1, BLOCK_N), part))  # one FMA a weight
    part = tl.fma(f2, _spread(x2, BLOCK_N), tl.fma(f3, _spread(x3, BLOCK_N), part))
    part = tl.fma(f4, _spread(x4, BLOCK_N), tl.fma(f5, _spread(x5, BLOCK_N), part))
    part = tl.fma(f6, _spread(x6, BLOCK_N), tl.fma(f7, _spread(x7, BLOCK_N), part))
    return part, xsum + (((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)))


@triton.jit
def _strip_sum(w0, w1, w2, w3, xw_ptr, first, n_words, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
               ASM: tl.constexpr):
    """(sum over the strip's 32 K-rows of (128 + q) x, per column; sum of x) for the four words
    of a strip. x's rows are read as four 8-value pieces, a0..a7 = K-rows 0..7 of the strip and
    so on; in the fragment order word t's nibble 4c + r holds K-row 8r + 2t + c, so each word
    takes values 2t and 2t + 1 of every piece (registers named differently, no extra work)."""
    part = tl.zeros((first.shape[0], BLOCK_N), dtype=tl.float32)
    xsum = tl.zeros((first.shape[0], BLOCK_N // 4), dtype=tl.float32)
    a0, a1, a2, a3, a4, a5, a6, a7 = _x_values(xw_ptr, first, n_words, BLOCK_N, EVEN)
    b0, b1, b2, b3, b4, b5, b6, b7 = _x_values(xw_ptr, first + 1, n_words, BLOCK_N, EVEN)
    c0, c1, c2, c3, c4, c5, c6, c7 = _x_values(xw_ptr, first + 2, n_words, BLOCK_N, EVEN)
    d0, d1, d2, d3, d4, d5, d6, d7 = _x_values(xw_ptr, first + 3, n_words, BLOCK_N, EVEN)
    part, xsum = _word(w0, a0, b0, c0, d0, a1, b1, c1, d1, part, xsum, BLOCK_N, ASM)
    part, xsum = _word(w1, a2, b2, c2, d2, a3, b3, c3, d3, part, xsum, BLOCK_N, ASM)
    part, xsum = _word(w2, a4, b4, c4, d4, a5, b5, c5, d5, part, xsum, BLOCK_N, ASM)
    part, xsum = _word(w3, a6, b6, c6, d6, a7, b7, c7, d7, part, xsum, BLOCK_N, ASM)
    return part, xsum


@triton.jit
def _strip(qw_ptr, first, n2, N, n_words, EVEN: tl.constexpr):
    """A strip's words: word rows first .. first + 3 of the program's columns."""
    return (_words(qw_ptr, first, n2, N, n_words, EVEN), _words(qw_ptr, first + 1, n2, N, n_words, EVEN),
            _words(qw_ptr, first + 2, n2, N, n_words, EVEN), _words(qw_ptr, first + 3, n2, N, n_words, EVEN))


@triton.jit
def _columns(half, BLOCK_N: tl.constexpr, GATED: tl.constexpr):
    """The program's columns: BLOCK_N in a row, or GATED half as many of gate and the same of up
    (`half` columns further), each half in runs of 4 (a thread's vector)."""
    j = tl.arange(0, BLOCK_N)
    if GATED:
        return tl.program_id(0) * (BLOCK_N // 2) + j % (BLOCK_N // 2) + (j // (BLOCK_N // 2)) * half
    return tl.program_id(0) * BLOCK_N + j


@triton.jit
def _store(out_ptr, y, half, r_ptr, nw_ptr, scaled_ptr, ss_ptr, BLOCK_N: tl.constexpr, GATED: tl.constexpr,
           ADD_RESIDUAL: tl.constexpr, NORM_OUT: tl.constexpr):
    """The column sums y [BLOCK_N] to out, or GATED silu(gate) * up (each first rounded to out's
    dtype, as gate_up's own output would be) to out[program's gate columns], or with ADD_RESIDUAL
    y + residual, its sum of squares and times the next norm's weight (store_residual_sum)."""
    dtype = out_ptr.dtype.element_ty
    if ADD_RESIDUAL:
        offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        store_residual_sum(out_ptr, ss_ptr, y, r_ptr, offs, offs < half, nw_ptr, scaled_ptr, NORM_OUT, dtype)
    elif GATED:
        gate, up = tl.split(tl.permute(tl.reshape(y, (2, BLOCK_N // 2)), (1, 0)))
        offs = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + offs, silu_mul_rounded(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype),
                 mask=offs < half)
    else:
        offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + offs, y.to(dtype), mask=offs < half)


@triton.jit
def gemv_kernel(xw_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, bias_ptr, r_ptr, nw_ptr, scaled_ptr, ss_ptr, N, K, half,
                parts, eps, GROUP: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
                GATED: tl.constexpr, HAS_BIAS: tl.constexpr, ADD_RESIDUAL: tl.constexpr, NORM_OUT: tl.constexpr,
                NORM_PARTS: tl.constexpr, ASM: tl.constexpr):
    """BLOCK_N columns of out = x @ W over all of K; with NORM_PARTS times rsqrt(mean + eps) of the
    sums of squares at ss (+ bias), then _store's epilogue."""
    n_words = K // 8
    p2 = tl.arange(0, P)[:, None]
    n2 = _columns(half, BLOCK_N, GATED)[None, :]
    acc = tl.zeros((P, BLOCK_N), dtype=tl.float32)
    w0_, w1_, w2_, w3_ = _strip(qw_ptr, p2 * 4, n2, N, n_words, EVEN)
    for w0 in range(0, n_words, 4 * P):
        first = w0 + p2 * 4  # thread row p owns word rows first .. first + 3: 32 K-rows of one group
        next0, next1, next2, next3 = _strip(qw_ptr, first + 4 * P, n2, N, n_words, EVEN)  # in flight meanwhile
        part, xsum = _strip_sum(w0_, w1_, w2_, w3_, xw_ptr, first, n_words, BLOCK_N, EVEN, ASM)
        g2 = (first * 8 // GROUP) * N + n2
        if EVEN:
            s = tl.load(s_ptr + g2).to(tl.float32)
            z = tl.load(z_ptr + g2).to(tl.float32)
        else:
            smask = (first < n_words) & (n2 < N)
            s = tl.load(s_ptr + g2, mask=smask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g2, mask=smask, other=0.0).to(tl.float32)
        acc += (part - (z + 128.0) * _spread(xsum, BLOCK_N)) * s
        w0_, w1_, w2_, w3_ = next0, next1, next2, next3
    y = tl.sum(acc, axis=0)
    if NORM_PARTS:
        y = y * inv_rms_parts(ss_ptr, parts, K, eps)
    if HAS_BIAS:
        cols = _columns(half, BLOCK_N, GATED)
        y += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    _store(out_ptr, y, half, r_ptr, nw_ptr, scaled_ptr, ss_ptr, BLOCK_N, GATED, ADD_RESIDUAL, NORM_OUT)


def gated_fits(n: int, cfg: Strips) -> bool:
    """Whether gemv(silu_mul=True) takes N packed gate + up columns in cfg's strips: whole runs of
    4 columns of each half in every program (the halves' vectors stay 16-byte loads)."""
    return n % 2 == 0 and cfg.block_n % 8 == 0 and (n // 2) % (cfg.block_n // 2) == 0


def _check_folds(n: int, half: int, silu_mul: bool, bias, add_residual, next_norm_weight, norm_parts) -> None:
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if add_residual is not None and silu_mul:
        raise ValueError("add_residual does not go with silu_mul")
    check_norm_fold(half, add_residual, next_norm_weight, norm_parts)


def gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
         cfg: Strips, silu_mul: bool = False, *, bias: torch.Tensor | None = None,
         add_residual: torch.Tensor | None = None, next_norm_weight: torch.Tensor | None = None,
         norm_parts: torch.Tensor | None = None, eps: float = 1e-6):
    """x [1, K] (bf16) @ the unpacked weight (+ bias [N]) -> [1, N] in x's dtype (K and the group,
    as the kernel layout holds it: K for one group per column, in whole strips of 32 K-rows:
    can_run). silu_mul: N packs gate and up (gate_up_proj's); the result is silu(gate) * up
    [1, N / 2]. The norm folds of dense_gemv (fused_ops.store_residual_sum): add_residual [1, N]
    returns (s = out + add_residual, each program's sum of s^2, s * next_norm_weight or None);
    norm_parts (those sums, with x = that product) scales the outputs by rsqrt(mean + eps)."""
    k, n = x.shape[1], qweight.shape[1]
    if silu_mul and not gated_fits(n, cfg):
        raise ValueError(f"silu_mul: {n} columns do not split into gate and up runs of {cfg.block_n // 2}")
    half = n // 2 if silu_mul else n
    _check_folds(n, half, silu_mul, bias, add_residual, next_norm_weight, norm_parts)
    # x is read as int32 pairs in 16-byte vectors, and Triton specializes on that alignment: an
    # unaligned view gets an aligned copy, so the launch keeps the variant compiled at start-up.
    if x.data_ptr() % 16:
        x = x.clone()
    p = cfg.warps * 128 // cfg.block_n  # thread rows: a warp's 32 threads, 4 columns each, over BLOCK_N
    out = torch.empty(1, half, dtype=x.dtype, device=x.device)
    programs = triton.cdiv(n, cfg.block_n)
    new_parts = torch.empty(programs, dtype=torch.float32, device=x.device) if add_residual is not None else None
    scaled = torch.empty_like(out) if next_norm_weight is not None else None
    ss = new_parts if new_parts is not None else norm_parts
    gemv_kernel[(programs,)](
        x.view(torch.int32), qweight, scales, zeros, out, *(t if t is not None else out for t in (
            bias, add_residual, next_norm_weight, scaled, ss)), n, k, half, ss.numel() if ss is not None else 0,
        float(eps), GROUP=group_size, P=p, BLOCK_N=cfg.block_n, EVEN=n % cfg.block_n == 0 and (k // 8) % (4 * p) == 0,
        GATED=silu_mul, HAS_BIAS=bias is not None, ADD_RESIDUAL=add_residual is not None,
        NORM_OUT=scaled is not None, NORM_PARTS=norm_parts is not None, ASM=not INTERPRETED, num_warps=cfg.warps)
    return out if add_residual is None else (out, new_parts, scaled)
