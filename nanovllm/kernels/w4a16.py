"""W4A16 GEMM in Triton: out[M, N] = x[M, K] @ W[K, N], W stored as 4-bit values q packed eight
to an int32 along K (qweight [K / 8, N]; nibble j of word row i is K-row fragment_row(i, j), the
fragment order of features/quantization/int4_formats.py) with per-group scales s and zero points
z [K / group_size, N]: W[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n].

Unpacking without integer-to-float conversions (a quarter-rate instruction that would cap the
kernel near half the memory bandwidth): a nibble moved to bits 16..19 and OR-ed into the bits of
128.0 is the float 128 + q, exactly (the float's ulp at 128 is 2^-16 = bit 16's weight). Then one
FMA makes (128 + q) * s - (128 + z) * s = (q - z) * s, exactly: (128 + z) * s and (q - z) * s
have at most 16 significant bits, so the weight equals the dequantized one rounded once, as a
16-bit checkpoint of it would hold.

Four launches (`choose` picks one by M):
- Strips, one bf16 row (batch-1 decode): kernels/w4a16_gemv.py, ~3.4 instructions a weight.
- Gemv, one fp16 row (or up to 4 rows when asked): a GEMV on the FMA units. Each program owns a
  few output columns over the whole K (no split-K, so no atomics and no zeroing or casting
  kernels around it); a tile spans several groups (a scale row per word row). PREFETCH issues
  the next step's loads before this step's arithmetic, so a warp always has bytes in flight.
  FACTORED (one row of x) sums q_j * x_j per word with the nibble OR-ed in place into 2^23's
  bits (minus 2^23: no shifts) and applies the scale once per word: (sum - z * sum x) * s,
  about 6 instructions a weight.
- Mma, 2 <= M < DEQUANT_MIN_M: tensor-core tiles with the weight unpacked in registers
  (kernels/w4a16_mma.py); decode-sized M splits K (fp32 partial sums, which a second kernel
  adds in a fixed order).
- Dequant, from DEQUANT_MIN_M rows: the weight is unpacked into a 16-bit workspace and cuBLAS
  multiplies (prefill: the product is compute-bound, and cuBLAS's tiles are the fastest there).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.w4a16_gemv import Strips, gemv
from nanovllm.kernels.w4a16_mma import Mma, float_128, fragment_row, mma_matmul, nibble_128

GEMV_MAX_M = 4  # rows the FMA GEMV takes (choose gives it one fp16 row)
DEQUANT_MIN_M = 512
# A row count in each of choose's tensor-core ranges, and the last (65 and up: 64-row tiles
# up to a row count that depends on N, then 128).
WARM_UP_ROWS = (2, 17, 33, 65, DEQUANT_MIN_M - 1)


class Gemv(NamedTuple):
    block_n: int  # output columns per program
    block_w: int  # words (8 K-rows each) per step
    warps: int
    block_m: int = GEMV_MAX_M  # rows of x per program (at most)
    prefetch: bool = True  # the next step's loads issued before this step's arithmetic
    factored: bool = True  # one row: scales applied per word (fewer instructions, more registers)


class Dequant(NamedTuple):
    """From DEQUANT_MIN_M rows: the weight dequantized to x's dtype, then cuBLAS. The weight is
    written and read back whole: 0.5 + 2 + 2 bytes a weight through HBM (2.25x bf16's 2).
    Measured and dropped (H100, BENCHMARKS.md): L2-sized column chunks, each multiplied right
    after its dequantization, were slower than the whole weight at every chunk size (2-32 MB)."""
    block_w: int = 8
    block_n: int = 128


@triton.jit
def _gemv_step(qw_ptr, s_ptr, z_ptr, N, K, rows, n3, GROUP: tl.constexpr):
    """Word rows `rows` of the GEMV's columns: the words, each one's scale and zero point."""
    mask = (rows < K // 8) & (n3 < N)
    words = tl.load(qw_ptr + rows * N + n3, mask=mask, other=0)
    sz = (rows * 8 // GROUP) * N + n3  # each word row's group (a step spans several)
    s = tl.load(s_ptr + sz, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + sz, mask=mask, other=0.0).to(tl.float32)
    return words, s, z


@triton.jit
def _scaled_nibble(words, high, J: tl.constexpr):
    """q * 2^(4J) of nibbles 0..4 in place, q * 2^(4J - 16) of 5..7 from `high` (words >> 16):
    OR-ed into 2^23's bits the nibble is the float 2^23 + q * 2^sh, exactly; minus 2^23."""
    if J < 5:
        t = words & (0xF << (4 * J))
    else:
        t = high & (0xF << (4 * J - 16))
    return (t | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                 GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                 PREFETCH: tl.constexpr, FACTORED: tl.constexpr):
    # Every tensor lives in one 3-D layout [rows of x, word rows, columns], where broadcasting is
    # free: a 2-D words tile met with a 3-D product would cross shared memory at every nibble.
    m3 = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M))[:, None, None]
    w3 = tl.arange(0, BLOCK_W)[None, :, None]
    n3 = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N))[None, None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_W, BLOCK_N), dtype=tl.float32)
    words, s, z = _gemv_step(qw_ptr, s_ptr, z_ptr, N, K, w3, n3, GROUP)
    for w0 in range(0, K // 8, BLOCK_W):
        rows = w0 + w3  # word rows: nibble j is K-row fragment_row(rows, j)
        if PREFETCH:  # the next step's words in flight while this one computes
            nxt = _gemv_step(qw_ptr, s_ptr, z_ptr, N, K, rows + BLOCK_W, n3, GROUP)
        else:
            words, s, z = _gemv_step(qw_ptr, s_ptr, z_ptr, N, K, rows, n3, GROUP)
        xmask = (m3 < M) & (rows < K // 8)
        if FACTORED:  # per word: sum_j q_j x_j, then (that - z * sum_j x_j) * s
            high = words >> 16
            part = tl.zeros((BLOCK_M, BLOCK_W, BLOCK_N), dtype=tl.float32)
            xsum = tl.zeros((BLOCK_M, BLOCK_W, 1), dtype=tl.float32)
            for j in tl.static_range(8):
                xj = tl.load(x_ptr + m3 * stride_xm + fragment_row(rows, j), mask=xmask, other=0.0).to(tl.float32)
                xsum += xj
                part += _scaled_nibble(words, high, j) * (xj * (1.0 / (1 << (4 * j if j < 5 else 4 * j - 16))))
            acc += tl.fma(-z, xsum, part) * s
        else:
            c = (z + 128.0) * s
            for j in tl.static_range(8):
                xj = tl.load(x_ptr + m3 * stride_xm + fragment_row(rows, j), mask=xmask, other=0.0).to(tl.float32)
                acc += xj * tl.fma(nibble_128(words, j), s, -c)  # x * (q - z) * s
        if PREFETCH:
            words, s, z = nxt
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, K, GROUP: tl.constexpr, BLOCK_W: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """The weight [K, N] into out [K, N] in out's dtype: word row i's nibble j is K-row
    fragment_row(i, j)."""
    w3 = (tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W))[:, None, None]
    j3 = tl.arange(0, 8)[None, :, None]
    n3 = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N))[None, None, :]
    mask = (w3 < K // 8) & (n3 < N)
    words = tl.load(qw_ptr + w3 * N + n3, mask=mask, other=0)
    sz = (w3 * 8 // GROUP) * N + n3
    s = tl.load(s_ptr + sz, mask=mask, other=0.0).to(tl.float32)
    c = (tl.load(z_ptr + sz, mask=mask, other=0.0).to(tl.float32) + 128.0) * s
    q = float_128(((words >> (4 * j3)) & 0xF) << 16)
    tl.store(out_ptr + fragment_row(w3, j3) * N + n3, tl.fma(q, s, -c).to(out_ptr.dtype.element_ty),
             mask=mask & (j3 < 8))


def _dequant_matmul(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, cfg: Dequant, workspace: torch.Tensor | None) -> torch.Tensor:
    """x2 @ the weight dequantized into the workspace (or a new buffer)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    w = workspace[: k * n].view(k, n) if workspace is not None else torch.empty(k, n, dtype=x2.dtype,
                                                                                 device=x2.device)
    _dequant_kernel[(triton.cdiv(k // 8, cfg.block_w), triton.cdiv(n, cfg.block_n))](
        qweight, scales, zeros, w, n, k, GROUP=group_size, BLOCK_W=cfg.block_w, BLOCK_N=cfg.block_n)
    return x2 @ w


def _pow2_divisor(g: int, cap: int) -> int:
    """The largest power of two <= cap that divides g."""
    b = cap
    while g % b:
        b //= 2
    return b


def choose(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> Strips | Gemv | Mma | Dequant:
    """The launch for an [m, k] x [k, n] product, from sweeps on an H100 of Qwen3-8B's shapes
    (benchmarks/kernels/bench_w4a16.py; BENCHMARKS.md). One bf16 row: the strips GEMV, 16 columns
    a program (32 from N = 16384: gate_up); one fp16 row: the FMA GEMV. 2-64 rows: tensor-core
    tiles of 16 / 32 / 64 rows of x and 64 columns (from 17 rows and K >= 8192, down's: 128 on 8
    warps), K split 4 ways unless the columns alone make enough programs (N >= 16384). 65 rows
    up to DEQUANT_MIN_M: 128-row tiles (64 while those would make under 90 programs: at 128 rows
    o and down 18-19% faster; down's K = 12288 up to 128 rows split 4 ways), 64-row K-steps
    four deep. From DEQUANT_MIN_M: dequantize + cuBLAS."""
    if m == 1:
        if dtype == torch.bfloat16:
            return Strips(32 if n >= 16384 else 16)
        block_n, block_w = (32, 64) if n >= 16384 else (8, 256) if k >= 8192 else (16, 128)
        return Gemv(block_n, block_w, 8, GEMV_MAX_M, True, True)
    if m >= DEQUANT_MIN_M:
        return Dequant()
    if m > 64:  # 128-row tiles, or 64 where those would leave most SMs idle (o, down: N = 4096)
        if k >= 8192 and m <= 128:  # (down: 64 programs of K = 12288 each; split 4 ways, 62 -> 47-53 us)
            return Mma(128, 64, _pow2_divisor(k, 64), 4, 4, 4)
        return Mma(128 if triton.cdiv(n, 64) * triton.cdiv(m, 128) >= 90 else 64, 64, _pow2_divisor(k, 64), 1, 4, 4)
    block_k = _pow2_divisor(k, 128)
    block_m = max(16, triton.next_power_of_2(m))
    wide = m > 16 and k >= 8192
    return Mma(block_m, 128 if wide else 64, block_k, 1 if n >= 16384 else min(4, k // block_k), 8 if wide else 4)


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, config: Strips | Gemv | Mma | Dequant | None = None,
                 workspace: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (fp16 / bf16; fp32 under the interpreter) @ the unpacked weight [K, N] ->
    [..., N] in x's dtype; `can_run` says which shapes it takes. `config`: a launch instead of
    `choose`'s (benchmarks; an Mma config's block_k must divide K). `workspace`: a
    flat buffer of x's dtype with room for K x N, for the Dequant path (else one is allocated)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if x.shape[-1] != k or scales.shape != zeros.shape or scales.shape[1] != n or not can_run(k, group_size):
        raise ValueError(f"w4a16_matmul: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, scales "
                         f"{tuple(scales.shape)}, zeros {tuple(zeros.shape)}, group_size {group_size} do not fit")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    cfg = config or choose(m, n, k, x2.dtype)
    if isinstance(cfg, Strips):
        if m != 1 or x2.dtype != torch.bfloat16:
            raise ValueError(f"w4a16_matmul: {cfg} takes one bf16 row of x, not {tuple(x2.shape)} {x2.dtype}")
        out = gemv(x2, qweight, scales, zeros, group_size, cfg)
    elif isinstance(cfg, Gemv):
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        block_m = min(cfg.block_m, triton.next_power_of_2(m))
        _gemv_kernel[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, block_m))](
            x2, qweight, scales, zeros, out, m, n, k, x2.stride(0), out.stride(0), GROUP=group_size,
            BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_W=cfg.block_w, PREFETCH=cfg.prefetch, FACTORED=cfg.factored,
            num_warps=cfg.warps)
    elif isinstance(cfg, Dequant):
        out = _dequant_matmul(x2, qweight, scales, zeros, group_size, cfg, workspace)
    else:
        out = mma_matmul(x2, qweight, scales, zeros, group_size, cfg)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def can_run(k: int, group_size: int) -> bool:
    """Whether the kernels take a weight of K input features in groups of `group_size` (K and the
    groups in whole 32-row fragment blocks)."""
    return k % 32 == 0 and group_size % 32 == 0 and k % group_size == 0


def warm_up(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
            dtype: torch.dtype) -> None:
    """Compile the tensor-core launches `choose` picks for 2 to DEQUANT_MIN_M - 1 rows of x on
    this weight, one launch a range (WARM_UP_ROWS): the kernel does not specialize on M, so every
    row count of a range runs the variant compiled here. (Decode graphs compile only their batch
    sizes'; a mixed or prefill step of another size would otherwise compile inside a user's run.
    One row and DEQUANT_MIN_M rows and up compile in the graphs and the warm-up prefill.)"""
    k = qweight.shape[0] * 8
    for m in WARM_UP_ROWS:
        w4a16_matmul(torch.zeros(m, k, dtype=dtype, device=qweight.device), qweight, scales, zeros, group_size)
