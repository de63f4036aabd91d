"""FP8 (e4m3) GEMM building blocks in Triton: activation quantizers and a block-scaled GEMM.

- `quantize_fp8_per_token_group`: dynamic 1x128 activation quantization (Qwen's block-FP8 scheme).
- `quantize_fp8_per_tensor`: dynamic per-tensor activation quantization with no host sync
  (CUDA-graph capturable), for torch._scaled_mm tensor-wise.
- `fp8_block_matmul`: out = (a_q * a_scales) @ (w_q * w_scales)^T with one activation scale per
  (token, 128 of K) and one weight scale per 128x128 block, fp32 accumulation.

The quantizers compute exactly the arithmetic of the torch references in
nanovllm/features/quantization/fp8_ops.py, so their codes and scales match bit for bit:
scale = max(amax / 448, FP8_MIN_SCALE), q = fp8_rne(clamp(x * (1 / scale), -448, 448)). Both
divisions are `tl.div_rn` (IEEE round to nearest, like torch): a plain fp32 `/` lowers to an
approximate division on NVIDIA. Each element then costs one fp32 product with the group's
reciprocal instead of a division of its own.

The quantizers are compiled with fp fusion off: nothing in them should contract into an FMA,
and bit-exactness must not hinge on that. Wrappers validate on the host only, allocate their
outputs, and launch a fixed tile config picked by M (no autotuning: the first call compiles one
kernel per config, nothing more).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8_format import BLOCK, FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# fp8_block_matmul tile configs: (largest M served, config). Decode-sized M gets short, narrow
# tiles so that a skinny GEMM still spreads over the 132 SMs (N / BLOCK_N programs); prefill gets
# 128x128 tiles, the usual Hopper fp8 shape. Tuned with benchmarks/kernels/bench_fp8_gemm.py.
BLOCK_MATMUL_CONFIGS: tuple[tuple[int | None, dict], ...] = (
    (16, dict(BLOCK_M=16, BLOCK_N=32, GROUP_M=1, num_warps=4, num_stages=4)),
    (64, dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=8, num_warps=4, num_stages=4)),
    (None, dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3)),
)


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")


def _check_matrix(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if t.stride(1) != 1 and t.shape[1] > 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {t.stride()}")


def _check_same_device(**tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors.values() if t is not None}
    if len(devices) != 1:
        raise ValueError(f"{', '.join(tensors)} must be on one device, got {sorted(map(str, devices))}")


@triton.jit
def _to_e4m3(v, FP8_MAX: tl.constexpr):
    """float8_e4m3fn of fp32 v: clamp to +-FP8_MAX, round to nearest even onto the e4m3 grid.

    The rounding is done here in fp32, and the cast then only sees exact values: Triton's
    interpreter rounds fp32 -> fp8 without carrying into the exponent (124.3 becomes 64), so a
    plain cast would not be testable on CPU. (a + c) - c rounds a to a multiple of c * 2**-23,
    the e4m3 spacing when c = 2**(max(e, -6) + 20) for a in [2**e, 2**(e + 1)) (normals: 3
    mantissa bits; below 2**-6, the subnormals' fixed 2**-9); fp32 addition breaks ties to even.
    The sign goes back on by a product with +-1, so -0.0 stays -0.0 as in torch's cast.
    """
    a = tl.minimum(tl.abs(v), FP8_MAX)
    exponent = a.to(tl.int32, bitcast=True) >> 23
    c = ((tl.maximum(exponent, 127 - 6) + 20) << 23).to(tl.float32, bitcast=True)
    sign = tl.where(v.to(tl.int32, bitcast=True) < 0, -1.0, 1.0)
    return (((a + c) - c) * sign).to(tl.float8e4nv)


# ----------------------------------------------------------------------------- per-token-group quantization


@triton.jit
def _quant_group_kernel(x_ptr, q_ptr, s_ptr, K, n_groups, stride_xm, stride_qm, stride_sm, stride_sg,
                        GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr, FP8_MAX: tl.constexpr,
                        MIN_SCALE: tl.constexpr):
    """Quantize GROUPS_PER_PROG groups of GROUP elements of one row of x [M, K].

    Grid (M, cdiv(n_groups, GROUPS_PER_PROG)). x rows are stride_xm apart (last dim contiguous),
    q [M, K] rows stride_qm apart; the scale of (row m, group g) goes to s_ptr + m * stride_sm +
    g * stride_sg (either layout of the scales). Lanes past K load 0, which leaves amax alone.
    """
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=1), FP8_MAX), MIN_SCALE)
    inv = tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    tl.store(q_ptr + row * stride_qm + cols, _to_e4m3(x * inv[:, None], FP8_MAX), mask=mask)
    tl.store(s_ptr + row * stride_sm + g * stride_sg, scale, mask=g < n_groups)


def quantize_fp8_per_token_group(x: torch.Tensor, group_size: int = BLOCK,
                                 column_major_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization of x [M, K] (fp16/bf16/fp32, last dim contiguous) per token in
    groups of `group_size` (a power of two, 16..1024) along K.

    Returns q [M, K] float8_e4m3fn and scales fp32 [M, ceil(K / group_size)] with
    x[m, k] ~= q[m, k] * scales[m, k // group_size], scale = max(group amax / 448, 1e-12) (the
    floor keeps all-zero groups finite: q = 0). With column_major_scales the scales are stored as
    [G, M] and returned as its transpose (shape [M, G], stride (1, M)): the outer-dim-major layout
    that F.scaled_mm's BlockWise1x128 expects. Bit-identical to quantize_per_token_group_torch.
    """
    _check_float("x", x)
    _check_matrix("x", x)
    if group_size < 16 or group_size > 1024 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two in [16, 1024], got {group_size}")
    m, k = x.shape
    n_groups = triton.cdiv(k, group_size)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    if column_major_scales:
        scales = torch.empty(n_groups, m, dtype=torch.float32, device=x.device).t()
    else:
        scales = torch.empty(m, n_groups, dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scales
    # ~1k elements a program: 8 KB of bf16 in flight, enough to hide the load latency.
    per_prog = max(1, min(triton.next_power_of_2(n_groups), 1024 // group_size))
    grid = (m, triton.cdiv(n_groups, per_prog))
    _quant_group_kernel[grid](x, q, scales, k, n_groups, x.stride(0), q.stride(0), scales.stride(0),
                              scales.stride(1), GROUP=group_size, GROUPS_PER_PROG=per_prog, FP8_MAX=FP8_MAX,
                              MIN_SCALE=FP8_MIN_SCALE, num_warps=4, enable_fp_fusion=False)
    return q, scales


# ----------------------------------------------------------------------------- per-tensor quantization


# Programs of the per-tensor amax: about two an SM of an H200, each writing the max of its rectangle
# to a slot of its own (no zeroed buffer, no atomics); the quantize kernel reduces the slots.
AMAX_PARTS = 256


@triton.jit
def _max_nan(v):
    """The max of all of v, NaN if any element is (tl.max alone may drop NaNs)."""
    return tl.where(tl.sum((v != v).to(tl.int32)) > 0, float("nan"), tl.max(v))


@triton.jit
def scale_and_inverse(amax, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """(scale, 1 / scale) of an amax: scale = max(amax / 448, MIN_SCALE), NaN kept, both IEEE divisions."""
    scale = tl.maximum(tl.div_rn(amax, FP8_MAX), MIN_SCALE, propagate_nan=tl.PropagateNan.ALL)
    return scale, tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


# M and the slices vary with the step's rows: not specialized (== 1, multiple of 16), so that the
# variants start-up compiles serve every step (no compile inside a run; they only bound loops).
@triton.jit(do_not_specialize=["M", "rows_per_part"])
def _amax_parts_kernel(x_ptr, part_ptr, M, K, stride_xm, rows_per_part, k_per_part, TILE_M: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """part[p] = max |x| over one rectangle of x [M, K]: rows [i * rows_per_part, ...) and
    columns [j * k_per_part, ...) for program (i, j), p = i * programs_along_K + j (NaN if any
    element is: torch's amax propagates it). Few rows get K split too, so that a decode-sized x
    still spreads over a few hundred programs."""
    first = tl.program_id(0) * rows_per_part
    end = tl.minimum(first + rows_per_part, M)
    k_first = tl.program_id(1) * k_per_part
    k_end = tl.minimum(k_first + k_per_part, K)
    acc = tl.zeros([TILE_M, BLOCK_K], tl.float32)
    for m0 in range(first, end, TILE_M):
        rows = (m0 + tl.arange(0, TILE_M)).to(tl.int64)
        for k0 in range(k_first, k_end, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = (rows[:, None] < end) & (cols[None, :] < k_end)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
            acc = tl.maximum(acc, tl.abs(x.to(tl.float32)), propagate_nan=tl.PropagateNan.ALL)
    tl.store(part_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), _max_nan(acc))


@triton.jit(do_not_specialize=["M", "parts"])
def _quant_tensor_kernel(x_ptr, q_ptr, part_ptr, parts, scale_ptr, M, K, stride_xm, stride_qm,
                         PARTS_PAD: tl.constexpr, TILE_M: tl.constexpr, BLOCK_K: tl.constexpr,
                         FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """q = fp8(clamp(x * (1 / scale))) for one [TILE_M, BLOCK_K] tile of x [M, K], with
    scale = max(amax / 448, MIN_SCALE) and amax the max of the `parts` slots _amax_parts_kernel
    left (a few hundred floats, from L2).

    Grid (cdiv(M, TILE_M), cdiv(K, BLOCK_K)); program (0, 0) also stores the scale."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    slots = tl.arange(0, PARTS_PAD)
    scale, inv = scale_and_inverse(_max_nan(tl.load(part_ptr + slots, mask=slots < parts, other=0.0)),
                                   FP8_MAX, MIN_SCALE)
    rows = (pid_m * TILE_M + tl.arange(0, TILE_M)).to(tl.int64)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], _to_e4m3(x * inv, FP8_MAX), mask=mask)
    if pid_m == 0 and pid_k == 0:
        tl.store(scale_ptr, scale)


def quantize_fp8_per_tensor(x: torch.Tensor, scale_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-tensor FP8 quantization of x [M, K] (fp16/bf16/fp32, last dim contiguous).

    Returns q [M, K] float8_e4m3fn and scale, an fp32 tensor of shape [1] (torch._scaled_mm's
    tensor-wise check is numel() == 1 in fp32, so [1] and [] both pass on torch 2.11 and 2.13),
    with x ~= q * scale, scale = max(amax / 448, 1e-12). `scale_out`, a float32 tensor of one
    element on x's device, receives the scale instead of a new tensor. Two launches (the amax of
    row slices into slots, then the quantize kernel, which reduces the slots) and no host sync:
    CUDA-graph capturable. Bit-identical to quantize_per_tensor_torch (a max is exact in any order).
    """
    _check_float("x", x)
    _check_matrix("x", x)
    if scale_out is None:
        scale_out = torch.empty(1, dtype=torch.float32, device=x.device)
    elif scale_out.dtype != torch.float32 or scale_out.numel() != 1 or scale_out.device != x.device:
        raise ValueError(f"scale_out must be one float32 element on {x.device}, got {scale_out.dtype} "
                         f"{tuple(scale_out.shape)} on {scale_out.device}")
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    if m == 0 or k == 0:
        scale_out.fill_(FP8_MIN_SCALE)
        return q, scale_out
    block_k = min(1024, triton.next_power_of_2(k))
    tile_m = max(1, 4096 // block_k)
    row_tiles, k_tiles = triton.cdiv(m, tile_m), triton.cdiv(k, block_k)
    k_parts = min(k_tiles, max(1, AMAX_PARTS // row_tiles))  # K split only where rows are few
    rows_per_part = triton.cdiv(row_tiles, AMAX_PARTS // k_parts) * tile_m  # whole tiles a slot
    k_per_part = triton.cdiv(k_tiles, k_parts) * block_k
    grid = (triton.cdiv(m, rows_per_part), triton.cdiv(k, k_per_part))
    parts = grid[0] * grid[1]  # <= AMAX_PARTS: at most AMAX_PARTS // k_parts row slices of k_parts
    part = torch.empty(parts, dtype=torch.float32, device=x.device)
    _amax_parts_kernel[grid](x, part, m, k, x.stride(0), rows_per_part, k_per_part, TILE_M=tile_m,
                             BLOCK_K=block_k, num_warps=4)
    # PARTS_PAD fixed (not the next power of two of `parts`, which varies with M): one variant for
    # every step; the slots past `parts` are masked, so no bytes move for them.
    _quant_tensor_kernel[(row_tiles, k_tiles)](
        x, q, part, parts, scale_out, m, k, x.stride(0), q.stride(0), PARTS_PAD=AMAX_PARTS,
        TILE_M=tile_m, BLOCK_K=block_k, FP8_MAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE, num_warps=4,
        enable_fp_fusion=False)
    return q, scale_out


# ----------------------------------------------------------------------------- block-scaled GEMM


@triton.jit
def _fp8_block_matmul_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K,
                             stride_am, stride_asm, stride_ask, stride_wn, stride_wsn, stride_wsk, stride_om,
                             HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """out[m, n] = sum_k a[m, k] * as[m, k // 128] * w[n, k] * ws[n // 128, k // 128] (+ bias[n]).

    a [M, K], w [N, K] float8_e4m3fn (last dims contiguous); as fp32, ws fp32/bf16/fp16 at any
    strides; out [M, N] rows stride_om apart. BLOCK_K = 128: one activation scale per row and one
    weight scale per tile for each K step (BLOCK_N divides 128, so a column tile lies in one
    weight-scale row). 1-D grid over the tiles, GROUP_M row tiles side by side so that their
    weight tiles are read from L2 rather than HBM. Masked loads give 0 past M, N, K, which adds
    nothing to the sums.
    """
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    as_ptrs = as_ptr + rows * stride_asm
    ws_ptrs = ws_ptr + (pid_n * BLOCK_N // 128) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = ks < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=(rows[:, None] < M) & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=(cols[:, None] < N) & k_mask[None, :], other=0.0)
        a_scale = tl.load(as_ptrs + kb * stride_ask, mask=rows < M, other=0.0)
        w_scale = tl.load(ws_ptrs + kb * stride_wsk).to(tl.float32)
        # A fresh dot per 128 of K, scaled and added in fp32: this is also what bounds Hopper's
        # reduced-precision fp8 accumulation (Triton's sm90 default) to 128 products.
        acc += tl.dot(a, tl.trans(w)) * (a_scale[:, None] * w_scale)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def _block_matmul_config(m: int) -> dict:
    for max_m, cfg in BLOCK_MATMUL_CONFIGS:
        if max_m is None or m <= max_m:
            return cfg
    raise AssertionError("BLOCK_MATMUL_CONFIGS must end with a catch-all (None) entry")


def fp8_block_matmul(a_q: torch.Tensor, a_scales: torch.Tensor, w_q: torch.Tensor, w_scales: torch.Tensor,
                     out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                     block_size: tuple[int, int] = (BLOCK, BLOCK), config: dict | None = None) -> torch.Tensor:
    """out [M, N] = (a_q * a_scales) @ (w_q * w_scales)^T (+ bias) in `out_dtype`, fp32 accumulation.

    a_q [M, K] and w_q [N, K] float8_e4m3fn with contiguous last dims; a_scales fp32
    [M, ceil(K/128)] (either layout: row-major, or outer-dim-major as F.scaled_mm wants);
    w_scales fp32/bf16/fp16 [ceil(N/128), ceil(K/128)] (Qwen's weight_scale_inv); bias [N] any
    float dtype, added in fp32; out_dtype fp16/bf16/fp32. M, N, K need not be multiples of 128.
    block_size must be (128, 128). `config` (BLOCK_M, BLOCK_N dividing 128, GROUP_M, num_warps,
    num_stages) overrides the one BLOCK_MATMUL_CONFIGS picks by M (for benchmarks).
    """
    if tuple(block_size) != (BLOCK, BLOCK):
        raise ValueError(f"fp8_block_matmul supports block_size (128, 128) only, got {tuple(block_size)}")
    for name, t in (("a_q", a_q), ("w_q", w_q)):
        if t.dtype != FP8_DTYPE:
            raise ValueError(f"{name} must be float8_e4m3fn, got {t.dtype}")
        _check_matrix(name, t)
    m, k = a_q.shape
    n = w_q.shape[0]
    if w_q.shape[1] != k:
        raise ValueError(f"a_q [M, K] and w_q [N, K] disagree on K: {tuple(a_q.shape)} vs {tuple(w_q.shape)}")
    kb = triton.cdiv(k, BLOCK)
    if a_scales.dtype != torch.float32 or tuple(a_scales.shape) != (m, kb):
        raise ValueError(f"a_scales must be float32 of shape {(m, kb)}, got {a_scales.dtype} {tuple(a_scales.shape)}")
    if w_scales.dtype not in _FLOAT_DTYPES or tuple(w_scales.shape) != (triton.cdiv(n, BLOCK), kb):
        raise ValueError(f"w_scales must be float32/bfloat16/float16 of shape {(triton.cdiv(n, BLOCK), kb)}, "
                         f"got {w_scales.dtype} {tuple(w_scales.shape)}")
    if out_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    if bias is not None:
        _check_float("bias", bias)
        if tuple(bias.shape) != (n,) or bias.stride(0) != 1:
            raise ValueError(f"bias must be a contiguous ({n},) tensor, got shape {tuple(bias.shape)}")
    _check_same_device(a_q=a_q, a_scales=a_scales, w_q=w_q, w_scales=w_scales, bias=bias)
    cfg = dict(config or _block_matmul_config(m))
    if cfg["BLOCK_N"] > BLOCK or BLOCK % cfg["BLOCK_N"]:
        raise ValueError(f"BLOCK_N must divide 128, got {cfg['BLOCK_N']}")
    out = torch.empty(m, n, dtype=out_dtype, device=a_q.device)
    if m == 0 or n == 0:
        return out
    bm, bn = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _fp8_block_matmul_kernel[grid](a_q, a_scales, w_q, w_scales, bias if bias is not None else out, out, m, n, k,
                                   a_q.stride(0), a_scales.stride(0), a_scales.stride(1), w_q.stride(0),
                                   w_scales.stride(0), w_scales.stride(1), out.stride(0), HAS_BIAS=bias is not None,
                                   BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK, **cfg)
    return out
