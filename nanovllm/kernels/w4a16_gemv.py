"""W4A16 GEMV for one row of x (batch-1 decode): out[N] = x[K] @ W[K, N], the layout of
kernels/w4a16.py (qweight [K / 8, N], nibble j of word row i = K-row 8i + j; scales s and zero
points z [K / group, N]: W[k, n] = (q[k, n] - z) * s).

A decode step at batch 1 reads every weight once, so this kernel must keep the memory busy with
few instructions a weight. The H200 moves ~8.6e12 four-bit weights a second and issues ~3.3e13
thread instructions, so ~3.9 instructions a weight is the whole budget. Three choices fit it:
- Strips: each thread owns R consecutive word rows (one group: a single scale and zero point) of
  4 adjacent columns, loaded as 128-bit vectors. The tile is [R, P, BLOCK_N] with R in-thread, so
  summing over R is register arithmetic and x's values serve 4 columns.
- Nibble as a float without conversion: moved to bits 16..19 and OR-ed into 128.0's bits it is
  the float 128 + q (kernels/w4a16_mma.py's nibble_128): a shift and a `lop3`, then one FMA with
  x. The 128 and the zero point come off once per group and column:
  sum x (q - z) = sum x (128 + q) - (128 + z) sum x, then times the scale. The fp32 sums lose
  nothing a 16-bit output can see (the 128 offset costs 7 of fp32's 24 bits).
- Bytes in flight: the next strip's words load before this strip's arithmetic (a register
  prefetch), and each program runs all of K for its columns (no split-K: no atomics, no extra
  launches), so there are enough programs only with narrow BLOCK_N (32 columns).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.w4a16_mma import INTERPRETED, nibble_128


class Strips(NamedTuple):
    block_n: int = 32  # columns per program: two halves, each thread 4 columns of each
    warps: int = 8


# Eight nibbles of a word as the floats 128 + q, 1.25 integer instructions a weight (the H200's
# integer pipes issue at half the FMA rate, so these count double): two masks split the word into
# its even and odd nibbles, one per byte; `prmt` then builds each float from one of those bytes at
# bits 16..23 (high nibble zero) under 128.0's exponent byte 0x43 (the register `m`).
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
def _x_pair(xw_ptr, offs, mask):
    """Two bf16 values of x from one int32 (x viewed as words): each one's bits moved to the top
    16 of an fp32 are that value exactly (a shift or a mask, no conversion)."""
    v = tl.load(xw_ptr + offs, mask=mask, other=0)
    return (v << 16).to(tl.float32, bitcast=True), (v & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _words(qw_ptr, rows, n2, N, n_words, EVEN: tl.constexpr):
    """Word row `rows` [P, 1] of columns n2 [1, HALF] (a row past the end reads the last one)."""
    if EVEN:
        return tl.load(qw_ptr + tl.minimum(rows, n_words - 1) * N + n2)
    return tl.load(qw_ptr + tl.minimum(rows, n_words - 1) * N + n2, mask=n2 < N, other=0)


@triton.jit
def _strip(qw_ptr, first, na, nb, N, n_words, EVEN: tl.constexpr):
    """A strip's words: rows first .. first + 3 of both column halves."""
    return (_words(qw_ptr, first, na, N, n_words, EVEN), _words(qw_ptr, first + 1, na, N, n_words, EVEN),
            _words(qw_ptr, first + 2, na, N, n_words, EVEN), _words(qw_ptr, first + 3, na, N, n_words, EVEN),
            _words(qw_ptr, first, nb, N, n_words, EVEN), _words(qw_ptr, first + 1, nb, N, n_words, EVEN),
            _words(qw_ptr, first + 2, nb, N, n_words, EVEN), _words(qw_ptr, first + 3, nb, N, n_words, EVEN))


@triton.jit
def _dot8(words, x0, x1, x2, x3, x4, x5, x6, x7, part, ASM: tl.constexpr):
    """part + the word row's eight (128 + q) times x's eight values: one FMA a weight."""
    f0, f1, f2, f3, f4, f5, f6, f7 = _floats_128(words, ASM)
    part = tl.fma(f0, x0, tl.fma(f1, x1, tl.fma(f2, x2, tl.fma(f3, x3, part))))
    return tl.fma(f4, x4, tl.fma(f5, x5, tl.fma(f6, x6, tl.fma(f7, x7, part))))


@triton.jit
def _row(wa, wb, xw_ptr, rows, n_words, pa, pb, xsum, ASM: tl.constexpr):
    """One word row of both halves: x's eight values read once for the 8 columns of a thread."""
    x0, x1 = _x_pair(xw_ptr, rows * 4, rows < n_words)
    x2, x3 = _x_pair(xw_ptr, rows * 4 + 1, rows < n_words)
    x4, x5 = _x_pair(xw_ptr, rows * 4 + 2, rows < n_words)
    x6, x7 = _x_pair(xw_ptr, rows * 4 + 3, rows < n_words)
    pa = _dot8(wa, x0, x1, x2, x3, x4, x5, x6, x7, pa, ASM)
    pb = _dot8(wb, x0, x1, x2, x3, x4, x5, x6, x7, pb, ASM)
    return pa, pb, xsum + (((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)))


@triton.jit
def _scaled(part, xsum, s_ptr, z_ptr, g2, n2, first, N, n_words):
    """A strip's sums with the 128 and the zero point taken off, times the scale."""
    mask = (first < n_words) & (n2 < N)
    s = tl.load(s_ptr + g2 + n2, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g2 + n2, mask=mask, other=0.0).to(tl.float32)
    return (part - (z + 128.0) * xsum) * s


@triton.jit
def gemv_kernel(xw_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, N, K, GROUP: tl.constexpr, P: tl.constexpr,
                HALF: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr):
    n_words = K // 8
    p2 = tl.arange(0, P)[:, None]
    na = tl.program_id(0) * 2 * HALF + tl.arange(0, HALF)[None, :]  # the program's two column halves
    nb = na + HALF
    acc_a = tl.zeros((P, HALF), dtype=tl.float32)
    acc_b = tl.zeros((P, HALF), dtype=tl.float32)
    a0, a1, a2, a3, b0, b1, b2, b3 = _strip(qw_ptr, p2 * 4, na, nb, N, n_words, EVEN)
    for w0 in range(0, n_words, 4 * P):
        first = w0 + p2 * 4  # thread row p owns word rows first .. first + 3: 32 K-rows of one group
        # The next strip's words in flight while this one computes.
        c0, c1, c2, c3, d0, d1, d2, d3 = _strip(qw_ptr, first + 4 * P, na, nb, N, n_words, EVEN)
        pa = tl.zeros((P, HALF), dtype=tl.float32)
        pb = tl.zeros((P, HALF), dtype=tl.float32)
        xsum = tl.zeros((P, 1), dtype=tl.float32)
        pa, pb, xsum = _row(a0, b0, xw_ptr, first, n_words, pa, pb, xsum, ASM)
        pa, pb, xsum = _row(a1, b1, xw_ptr, first + 1, n_words, pa, pb, xsum, ASM)
        pa, pb, xsum = _row(a2, b2, xw_ptr, first + 2, n_words, pa, pb, xsum, ASM)
        pa, pb, xsum = _row(a3, b3, xw_ptr, first + 3, n_words, pa, pb, xsum, ASM)
        g2 = (first * 8 // GROUP) * N
        acc_a += _scaled(pa, xsum, s_ptr, z_ptr, g2, na, first, N, n_words)
        acc_b += _scaled(pb, xsum, s_ptr, z_ptr, g2, nb, first, N, n_words)
        a0, a1, a2, a3, b0, b1, b2, b3 = c0, c1, c2, c3, d0, d1, d2, d3
    offs = tl.program_id(0) * 2 * HALF + tl.arange(0, HALF)
    tl.store(out_ptr + offs, tl.sum(acc_a, axis=0).to(out_ptr.dtype.element_ty), mask=offs < N)
    tl.store(out_ptr + offs + HALF, tl.sum(acc_b, axis=0).to(out_ptr.dtype.element_ty), mask=offs + HALF < N)


def gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
         cfg: Strips) -> torch.Tensor:
    """x [1, K] @ the unpacked weight -> [1, N] in x's dtype (K and the group in whole strips of 32)."""
    k, n = x.shape[1], qweight.shape[1]
    group = group_size if group_size > 0 else k
    half = cfg.block_n // 2
    p = cfg.warps * 128 // half  # thread rows: a warp's 32 threads, 4 columns of each half each
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    even = n % cfg.block_n == 0 and (k // 8) % (4 * p) == 0
    gemv_kernel[(triton.cdiv(n, cfg.block_n),)](x.view(torch.int32), qweight, scales, zeros, out, n, k, GROUP=group,
                                                P=p, HALF=half, EVEN=even, ASM=not INTERPRETED, num_warps=cfg.warps)
    return out
