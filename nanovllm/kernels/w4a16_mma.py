"""W4A16 on the tensor cores: out[M, N] = x[M, K] @ W[K, N] with W unpacked in registers tile by
tile, the layout of features/quantization/int4_formats.py (qweight [K / 8, N], each block of 32
K-rows in fragment order: nibble j = 4c + 2a + b of word t is row 16a + 8b + 2t + c; scales s
and zero points z [K / group, N]: W[k, n] = (q[k, n] - z) * s).

The product is computed transposed, out^T = W^T x^T, so that the unpacked weight is the dot's
first operand, which Hopper's wgmma reads from registers, and x's few rows sit on the MMA's N
side (16-row tiles, not 64). Each program loads its words once ([BLOCK_N, BLOCK_K / 8] int32:
half a byte a weight from memory), unpacks their eight nibbles into eight [BLOCK_N, BLOCK_K / 8]
parts, and `tl.join`, a reshape and a permute lay them out as the [BLOCK_N, BLOCK_K] tile of
W^T in K order. In the fragment order that layout is the one wgmma's A operand wants: a thread
unpacks exactly the rows it feeds the MMA ({2l, 2l + 1} + {0, 8, 16, 24}, l = lane % 4), so the
tile makes no trip through shared memory. (With words in plain order, sm90's loop stored every
unpacked tile to shared memory and read it back with ldmatrix: 8 stores, 8 ldmatrix and ~11
barriers a step against 0, 0 and 2; on an H100 the fragment order made the GEMMs 1.0-2.9x
faster at 2-256 rows: BENCHMARKS.md.) The unpacking makes nibbles j and j + 4 in one 32-bit
register: stored as rows 2t + c for c = 0, 1, they are the register pair wgmma takes (in the
order before, 16 rows apart, so sm90's loop repacked every pair with a PRMT). Up to 256 rows of
x a program.

ASM (CUDA, sm_80 on): the unpacking is Marlin's in inline PTX, two weights an instruction each
step: `lop3` ORs the nibbles at bits 0 and 16 of a word (shifted by 4t) into the bits of the
16-bit float pair {128, 128} (bf16: 0x4300; fp16 1024: 0x6400), which is exactly {128 + q_t,
128 + q_t+4}; one packed FMA takes 128 + z (exact, small integers) and another multiplies by the
scale, rounded once: the weight equals (q - z) * s rounded to 16 bits, as a dequantized
checkpoint holds it. Under the interpreter (no PTX there) the same values are computed in fp32
and rounded once.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

# Nibbles t and t + 4 of a word as a 16-bit float pair, minus the (magic + z) pair (an FMA by 1:
# exact), times s (an FMA adding -0.0: one rounding). FMAs, not sub / mul, because bf16x2 sub and
# mul need sm_90 and bf16x2 fma sm_80 (f16x2: sm_53).
_PAIR = """
lop3.b32 t, {w}, 0x000F000F, {magic}, 0xEA;
fma.rn.{ty} t, t, one, z2;
fma.rn.{ty} t, t, s2, nzero;
mov.b32 {{{lo}, {hi}}}, t;"""


def _unpack_asm(magic: str, one: str, ty: str) -> str:
    """PTX: $8 a word, $9 its scale, $10 -(magic + z) -> $0..$7 its eight weights."""
    pair = dict(magic=magic, ty=ty)
    steps = [_PAIR.format(w="$8", lo="$0", hi="$4", **pair)]
    for t in (1, 2, 3):
        steps.append(f"\nshr.u32 w, $8, {4 * t};" + _PAIR.format(w="w", lo=f"${t}", hi=f"${t + 4}", **pair))
    return ("{\n.reg .b32 w, t, s2, z2, one, nzero;\nmov.b32 s2, {$9, $9};\nmov.b32 z2, {$10, $10};"
            f"\nmov.b32 one, {one};\nmov.b32 nzero, 0x80008000;" + "".join(steps) + "\n}")


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # (inline PTX does not run there)
UNPACK_BF16 = tl.constexpr(_unpack_asm("0x43004300", "0x3F803F80", "bf16x2"))
UNPACK_FP16 = tl.constexpr(_unpack_asm("0x64006400", "0x3C003C00", "f16x2"))


@triton.jit
def _nibbles_asm(words, s, z, DTYPE: tl.constexpr):
    """Eight [R, C] tensors: nibble j of each word as (q - z) * s in DTYPE (bf16 or fp16; inline
    PTX, which takes -(magic + z))."""
    s = tl.broadcast_to(s.to(DTYPE), words.shape)
    if DTYPE == tl.bfloat16:
        zc = tl.broadcast_to((-128.0 - z.to(tl.float32)).to(DTYPE), words.shape)
        return tl.inline_asm_elementwise(UNPACK_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", [words, s, zc],
                                         dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:
        zc = tl.broadcast_to((-1024.0 - z.to(tl.float32)).to(DTYPE), words.shape)
        return tl.inline_asm_elementwise(UNPACK_FP16, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", [words, s, zc],
                                         dtype=(tl.float16,) * 8, is_pure=True, pack=1)


@triton.jit
def float_128(q16):
    """The float 128 + q from q (0..15) already at bits 16..19: OR-ed into 128.0's bits (the
    float's ulp at 128 is 2^-16, bit 16's weight), with no int-to-float conversion."""
    return (q16 | 0x43000000).to(tl.float32, bitcast=True)


@triton.jit
def nibble_128(words, J: tl.constexpr):
    """Nibble J of each word as the float 128 + q (float_128), moved to bits 16..19 by one shift."""
    if J < 4:
        t = words << (16 - 4 * J)
    elif J == 4:
        t = words
    else:
        t = words >> (4 * J - 16)
    return float_128(t & 0xF0000)


@triton.jit
def fragment_row(word, j):
    """The K-row held by nibble j of word row `word` in the fragment order (module docstring)."""
    return (word // 4) * 32 + ((j // 2) % 2) * 16 + (j % 2) * 8 + (word % 4) * 2 + j // 4


@triton.jit
def fragment_word_and_shift(k):
    """The inverse of fragment_row for K-row k: (its word row, its nibble's bit offset 4j)."""
    return (k // 32) * 4 + (k % 8) // 2, ((k % 2) * 4 + ((k // 16) % 2) * 2 + (k // 8) % 2) * 4


@triton.jit
def _nibble(words, s, zc, J: tl.constexpr, DTYPE: tl.constexpr):
    """Nibble J as (q - z) * s in fp32 (zc = 128 + z), rounded once to DTYPE."""
    return ((nibble_128(words, J) - zc) * s).to(DTYPE)


@triton.jit
def _join8(v0, v1, v2, v3, v4, v5, v6, v7):
    """[R, C] x 8 -> [R, C, 2, 2, 2] holding value 4p + 2q + r at [.., p, q, r] (join stacks on a
    new last axis), so that a row-major flattening of the last three axes is 0..7 in order."""
    return tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))


@triton.jit
def _weight_tile(qw_ptr, s_ptr, z_ptr, N, k0, offs_w, offs_n, mask_n, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                 ASM: tl.constexpr, DTYPE: tl.constexpr, EVEN_N: tl.constexpr):
    """W^T's tile [BLOCK_N, BLOCK_K] of K-rows k0 .. k0 + BLOCK_K in DTYPE."""
    w2, n2 = (k0 // 8 + offs_w)[None, :], offs_n[:, None]
    if GROUP % BLOCK_K == 0:  # the tile lies in one group: a scale per column
        sz = (k0 // GROUP) * N + n2
    else:  # each word's own group (8 divides every group)
        sz = (w2 * 8 // GROUP) * N + n2
    if EVEN_N:  # whole column tiles: no masks (their predicates cost ~10% of the loop's instructions)
        words = tl.load(qw_ptr + w2 * N + n2)  # [BLOCK_N, BLOCK_K / 8]
        s, z = tl.load(s_ptr + sz), tl.load(z_ptr + sz)
    else:
        mn = mask_n[:, None]
        words = tl.load(qw_ptr + w2 * N + n2, mask=mn, other=0)
        s, z = tl.load(s_ptr + sz, mask=mn, other=0.0), tl.load(z_ptr + sz, mask=mn, other=0.0)
    return unpack_tile(words, s, z, BLOCK_K, ASM, DTYPE)


@triton.jit
def unpack_tile(words, s, z, BLOCK_K: tl.constexpr, ASM: tl.constexpr, DTYPE: tl.constexpr):
    """W^T's tile [BLOCK_N, BLOCK_K] in DTYPE from its words [BLOCK_N, BLOCK_K / 8] and their
    scales and zero points (broadcastable to the words)."""
    if ASM:
        v0, v1, v2, v3, v4, v5, v6, v7 = _nibbles_asm(words, s, z, DTYPE)
    else:
        sf, zc = s.to(tl.float32), z.to(tl.float32) + 128.0
        v0, v1, v2, v3 = (_nibble(words, sf, zc, 0, DTYPE), _nibble(words, sf, zc, 1, DTYPE),
                          _nibble(words, sf, zc, 2, DTYPE), _nibble(words, sf, zc, 3, DTYPE))
        v4, v5, v6, v7 = (_nibble(words, sf, zc, 4, DTYPE), _nibble(words, sf, zc, 5, DTYPE),
                          _nibble(words, sf, zc, 6, DTYPE), _nibble(words, sf, zc, 7, DTYPE))
    # [BLOCK_N, BLOCK_K / 8, c, a, b] holds word 4 * blk + t's nibble 4c + 2a + b, K-row 32 * blk
    # + 16a + 8b + 2t + c: (blk, t, c, a, b) permuted to (blk, a, b, t, c) is the K order, and c
    # (the asm's pairs: nibbles j, j + 4) lands innermost, as wgmma pairs its registers.
    v = tl.reshape(_join8(v0, v1, v2, v3, v4, v5, v6, v7), (words.shape[0], BLOCK_K // 32, 2, 2, 2, 2, 2))
    return tl.reshape(tl.permute(v, (0, 1, 5, 6, 2, 3, 4)), (words.shape[0], BLOCK_K))


@triton.jit
def _settled(acc):
    """acc through an empty inline asm: a use of the accumulator inside the K loop, so Triton waits
    for the step's wgmmas before the loop goes on. Without it Triton 3.6 leaves three in flight
    at the back edge while the next step's unpacking writes their register operand (undefined in
    PTX; wrong results seen with 8-warp 128 x 128 tiles, BENCHMARKS.md); with it the step's
    wgmmas also issue back to back, where 16- and 64-row tiles waited after each. mma_kernel
    settles tiles of up to 64 rows and 8-warp tiles (SETTLE). 4-warp 128- and 256-row tiles keep
    the overlap, measured faster (their unpacking runs while the last wgmmas finish; BENCHMARKS.md)
    and never seen wrong: test_chosen_launches_stay_right_when_programs_share_sms."""
    return tl.inline_asm_elementwise("", "=r,0", [acc], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit(do_not_specialize=["M", "stride_split"])  # (one variant serves every row count of a launch)
def mma_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_xm, stride_om, stride_split, k_per_split,
               GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               ASM: tl.constexpr, EVEN_N: tl.constexpr, SETTLE: tl.constexpr):
    """One program: out's tile of BLOCK_M rows and BLOCK_N columns over its share of K, split s
    of K writing its fp32 sums to out + s * stride_split (sum_splits adds them). x's rows stay
    masked: rows past M reading row M - 1 instead (no predicate a row and step) made a partial
    row tile several times slower, all its missing rows in every program reading one address; a
    second, unmasked K loop for whole row tiles doubled the pipelined shared memory
    (BENCHMARKS.md, the loop trim)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_w = tl.arange(0, BLOCK_K // 8)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    k_start = tl.program_id(2) * k_per_split
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # out^T
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        w = _weight_tile(qw_ptr, s_ptr, z_ptr, N, k0, offs_w, offs_n, mask_n, GROUP, BLOCK_K, ASM,
                         x_ptr.dtype.element_ty, EVEN_N)
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + (k0 + offs_k)[:, None], mask=mask_m[None, :], other=0.0)
        acc = tl.dot(w, xt, acc)
        if ASM and SETTLE:
            acc = _settled(acc)
    out = out_ptr + tl.program_id(2) * stride_split + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[None, :] & mask_n[:, None])


@triton.jit(do_not_specialize=["numel"])
def sum_splits_kernel(part_ptr, out_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """out = the SPLITS fp32 partial products at part (numel apart) added in split order, in
    out's dtype: the same bits every run, where atomic sums would add in arrival order."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


class Mma(NamedTuple):
    block_m: int  # rows of x per program (the MMA's N side: 16, 32, 64, 128 or 256)
    block_n: int  # output columns per program (the MMA's M side)
    block_k: int  # K-rows per step (a power of two from 32 that divides K)
    splits: int = 1  # K split into this many programs per tile (fp32 partials, summed after, when > 1)
    warps: int = 4
    stages: int = 3


def mma_matmul(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               group_size: int, cfg: Mma) -> torch.Tensor:
    """x2 [M, K] @ the unpacked weight -> [M, N] in x2's dtype. Split K: each split's fp32 sums
    to a partials buffer, then sum_splits_kernel adds them in a fixed order (deterministic; no
    zeroed output, no atomics, no separate cast)."""
    m, k, n = x2.shape[0], x2.shape[1], qweight.shape[1]
    tile_k_ok = k % cfg.block_k == 0 and cfg.block_k >= 32 and cfg.block_k & (cfg.block_k - 1) == 0
    if not tile_k_ok or cfg.block_m not in (16, 32, 64, 128, 256):
        raise ValueError(f"mma_matmul: {cfg} does not fit K = {k} (block_k: a power of two from 32 dividing K, "
                         f"no mask along K; block_m: 16, 32, 64, 128 or 256)")
    k_per_split = triton.cdiv(k // cfg.block_k, cfg.splits) * cfg.block_k  # whole tiles (the last split shorter)
    splits = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x2.device) if splits > 1 else out
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), splits)
    mma_kernel[grid](x2, qweight, scales, zeros, part, m, n, k, x2.stride(0), n, m * n, k_per_split,
                     GROUP=group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                     ASM=not INTERPRETED, EVEN_N=n % cfg.block_n == 0, SETTLE=cfg.block_m <= 64 or cfg.warps > 4,
                     num_warps=cfg.warps, num_stages=cfg.stages)
    if splits > 1:
        sum_splits_kernel[(triton.cdiv(m * n, 1024),)](part, out, m * n, SPLITS=splits, BLOCK=1024, num_warps=4)
    return out
