"""The fused-MoE kernel's FP8 activation quantizer: per row, per 128-column group, with the
arithmetic of its plain-torch twin (features/quantization/fp8_moe.py) bit for bit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# QUANT_BLOCK: activation scales per 128 columns. FP8_MIN_AMAX: a group whose amax is below it
# gets the scale of this amax. Shared with the plain-torch twin, so the two cannot drift apart.
from nanovllm.kernels.fp8_format import BLOCK as QUANT_BLOCK
from nanovllm.kernels.fp8_format import FP8_DTYPE, FP8_MAX, FP8_MIN_AMAX

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _round_to_e4m3(v):
    """fp32 v with |v| <= 448 rounded to the nearest float8_e4m3fn value (ties to even), still in
    fp32, so the cast that follows is exact. Rounding here rather than in the cast because
    Triton's interpreter rounds that cast half-up and drops the carry into the exponent (124.5
    becomes 64): with this the CPU tests check the same arithmetic the GPU runs.

    Adding magic = 1.5 * 2^(k + 23) leaves a sum whose ulp is 2^k, the e4m3 spacing at |v|
    (2^(e - 3) in binade 2^e, 2^-9 among the subnormals below 2^-6), so fp32's own
    round-to-nearest-even does the rounding; subtracting magic again is exact."""
    bits = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    k = tl.maximum(exponent, -6) - 3
    magic = (((k + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (a + magic) - magic
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _quant_fp8_kernel(x_ptr, q_ptr, s_ptr, rows, K, stride_xm, stride_qm, stride_sm,
                      GROUP: tl.constexpr, ROWS: tl.constexpr, FP8_MAX_C: tl.constexpr, MIN_AMAX: tl.constexpr):
    """Program (i, g): rows i*ROWS.. of column group g (GROUP columns). scale = max(amax,
    MIN_AMAX) / FP8_MAX, q = clamp(x / scale, +-FP8_MAX) in float8e4nv; both divisions rounded
    to nearest (div_rn) and the cast rounded to nearest even (`_round_to_e4m3`), so the result
    equals torch's fp32 arithmetic bit for bit."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    ok = (r < rows)[:, None] & (cols < K)[None, :]
    r64 = r.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, MIN_AMAX), FP8_MAX_C)
    q = tl.math.div_rn(x, scale[:, None])
    q = _round_to_e4m3(tl.minimum(tl.maximum(q, -FP8_MAX_C), FP8_MAX_C))
    tl.store(q_ptr + r64[:, None] * stride_qm + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + r64 * stride_sm + g, scale, mask=r < rows)


def quantize_fp8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row, per-128-column-group FP8 quantization of activations (one Triton launch).

    x: [M, K] float16/bfloat16/float32, stride(-1) == 1. Returns (q float8_e4m3fn [M, K]
    contiguous, scale fp32 [M, ceil(K / 128)]): for the group of columns 128g..128g+127 of row
    m, scale = max(amax, FP8_MIN_AMAX) / 448 and q = clamp(x / scale, -448, 448) rounded to
    nearest, computed in fp32 from x -- the same arithmetic as
    `(x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)` in torch.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [rows, K], got {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, K = x.shape
    num_groups = triton.cdiv(K, QUANT_BLOCK)
    q = torch.empty((rows, K), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, num_groups), dtype=torch.float32, device=x.device)
    if rows == 0 or K == 0:
        return q, scale
    block_rows = 16  # 16 x 128 elements a program: 16 per thread with 4 warps
    _quant_fp8_kernel[(triton.cdiv(rows, block_rows), num_groups)](
        x, q, scale, rows, K, x.stride(0), q.stride(0), scale.stride(0),
        GROUP=QUANT_BLOCK, ROWS=block_rows, FP8_MAX_C=FP8_MAX, MIN_AMAX=FP8_MIN_AMAX, num_warps=4)
    return q, scale
