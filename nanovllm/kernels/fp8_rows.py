"""FP8 activations with one scale per row, written by the kernels that make them.

Online FP8 (one weight scale per tensor) multiplies with cuBLASLt's tensor-wise GEMM, the fastest
FP8 GEMM on Hopper at decode sizes; with one activation scale per tensor, every GEMM input needs
an amax over the whole tensor and a cast before the GEMM can start: two launches, 9-14 us a GEMM
in CUDA graphs on an H200 (BENCHMARKS.md), more than the GEMMs themselves at 64-256 rows.
Here the kernel that makes a GEMM input instead quantizes each row it holds in registers with
the row's own scale (the row's amax is in that program's reach), and the GEMM runs tensor-wise
with activation scale 1: out' = codes @ W_q^T * w_scale. The row's scale multiplies out' in the
kernel that reads it next (`row_scale` of these kernels and of qk_norm_rope). No launch is added.

- `add_norm_quant`: (x * x_scale + residual) -> RMSNorm -> e4m3 codes + row scales (or the
  normed row in 16 bits: the last norm).
- `silu_mul_quant`: silu(gate * s) * (up * s) -> codes + row scales.
- `quantize_rows`: codes + row scales of any 16-bit rows (attention's output).

Arithmetic (tests/test_fp8_chain.py's torch reference of the chain does the same): a scaled input
x * s is rounded to the 16-bit dtype (the value the layer-by-layer path holds, one rounding
later); norm, residual add and SiLU round as fused_ops.py's kernels; a row y of 16-bit values
becomes scale = max(amax(|y|) / 448, 1e-12) and codes e4m3(clamp(y * (1 / scale))), both
divisions IEEE, as fp8_gemm.py's quantizers (fp fusion off). Rows of up to 32,768 elements, one
program a row (decode steps: a few hundred rows at most).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8_format import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE
from nanovllm.kernels.fp8_gemm import _max_nan, _to_e4m3, scale_and_inverse
from nanovllm.kernels.fused_ops import _MAX_HIDDEN, _num_warps, _rms_norm_row, silu_mul_rounded

ROW_DTYPES = (torch.bfloat16, torch.float16)
MAX_ROW = _MAX_HIDDEN  # the longest row one program holds (a GEMM input: hidden, heads x head_dim, intermediate)


@triton.jit
def _store_row_fp8(q_ptr, s_ptr, row, y, offs, mask, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """Quantize one fp32 row y (exact 16-bit values; masked lanes 0) with its own scale:
    codes at q_ptr + offs, the scale at s_ptr + row."""
    scale, inv = scale_and_inverse(_max_nan(tl.abs(y)), FP8_MAX, MIN_SCALE)  # NaN: as torch's amax
    tl.store(q_ptr + offs, _to_e4m3(y * inv, FP8_MAX), mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def _scaled_row(ptr, s_ptr, row, offs, mask, HAS_SCALE: tl.constexpr, dtype: tl.constexpr):
    """A 16-bit row in fp32, times its row scale (then rounded to the dtype) when HAS_SCALE."""
    x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        x = (x * tl.load(s_ptr + row)).to(dtype).to(tl.float32)
    return x


@triton.jit
def _add_norm_quant_kernel(x_ptr, xs_ptr, res_ptr, w_ptr, q_ptr, s_ptr, y_ptr, res_out_ptr, n_cols, eps,
                           X_SCALE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr,
                           BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """One row: s = x * x_scale (+ residual), stored to res_out with a residual; RMSNorm(s) as
    fused_ops.rms_norm; QUANT: its codes and row scale, else the normed row to y. Contiguous rows."""
    row = tl.program_id(0).to(tl.int64)
    dtype = res_out_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = _scaled_row(x_ptr + row * n_cols, xs_ptr, row, offs, mask, X_SCALE, dtype)
    if HAS_RESIDUAL:
        s = (x + tl.load(res_ptr + row * n_cols + offs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * n_cols + offs, s, mask=mask)
        x = s.to(tl.float32)
    y = _rms_norm_row(x, w_ptr, offs, mask, n_cols, eps, dtype)
    if QUANT:
        _store_row_fp8(q_ptr + row * n_cols, s_ptr, row, y.to(tl.float32), offs, mask, FP8_MAX, MIN_SCALE)
    else:
        tl.store(y_ptr + row * n_cols + offs, y, mask=mask)


@triton.jit
def _silu_mul_quant_kernel(x_ptr, xs_ptr, q_ptr, s_ptr, d, X_SCALE: tl.constexpr, BLOCK: tl.constexpr,
                           FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """One row of x [rows, 2d] (gate | up, times the row scale when X_SCALE): silu(gate) * up as
    fused_ops.silu_and_mul rounds it, quantized with the row's own scale. Contiguous rows."""
    row = tl.program_id(0).to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    mask = offs < d
    gate = _scaled_row(x_ptr + row * 2 * d, xs_ptr, row, offs, mask, X_SCALE, dtype)
    up = _scaled_row(x_ptr + row * 2 * d + d, xs_ptr, row, offs, mask, X_SCALE, dtype)
    y = silu_mul_rounded(gate, up, dtype).to(tl.float32)
    _store_row_fp8(q_ptr + row * d, s_ptr, row, y, offs, mask, FP8_MAX, MIN_SCALE)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, n_cols, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
                          MIN_SCALE: tl.constexpr):
    """One contiguous 16-bit row: its codes and row scale."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    _store_row_fp8(q_ptr + row * n_cols, s_ptr, row, x, offs, mask, FP8_MAX, MIN_SCALE)


def _check_rows(name: str, x: torch.Tensor, cols: int | None = None) -> None:
    if x.dtype not in ROW_DTYPES:
        raise ValueError(f"{name} must be bf16 or fp16, got {x.dtype}")
    if x.dim() != 2 or not x.is_contiguous() or not 0 < x.shape[1] <= 2 * _MAX_HIDDEN:
        raise ValueError(f"{name} must be contiguous rows [tokens, <= {_MAX_HIDDEN}], got {tuple(x.shape)}")
    if cols is not None and x.shape[1] != cols:
        raise ValueError(f"{name} must have {cols} columns, got {x.shape[1]}")


def _check_row_scale(name: str, s: torch.Tensor | None, rows: int) -> None:
    if s is not None and (s.dtype != torch.float32 or s.shape != (rows,) or not s.is_contiguous()):
        raise ValueError(f"{name} must be float32 [{rows}], got {s.dtype} {tuple(s.shape)}")


def _outputs(rows: int, cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(rows, cols, dtype=FP8_DTYPE, device=device),
            torch.empty(rows, dtype=torch.float32, device=device))


def add_norm_quant(x: torch.Tensor, x_scale: torch.Tensor | None, residual: torch.Tensor | None,
                   weight: torch.Tensor, eps: float, quantize: bool = True):
    """RMSNorm of s = x * x_scale (+ residual) over rows x [tokens, H] (16-bit, contiguous;
    x_scale fp32 [tokens] or None; residual like x or None): ((codes, row scales) when
    `quantize`, else the normed rows; then s when a residual was added, else None)."""
    _check_rows("x", x)
    rows, hidden = x.shape
    if hidden > MAX_ROW:
        raise ValueError(f"hidden size {hidden} exceeds the supported {MAX_ROW}")
    if residual is not None:
        _check_rows("residual", residual, hidden)
    if weight.shape != (hidden,) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{hidden}] {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    _check_row_scale("x_scale", x_scale, rows)
    q, s = _outputs(rows, hidden, x.device) if quantize else (None, None)
    y = None if quantize else torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    if rows:
        block = triton.next_power_of_2(hidden)
        _add_norm_quant_kernel[(rows,)](
            x, x_scale if x_scale is not None else x, residual if residual is not None else x, weight.contiguous(),
            q if quantize else x, s if quantize else x, y if y is not None else x,
            res_out if res_out is not None else x, hidden, float(eps), X_SCALE=x_scale is not None,
            HAS_RESIDUAL=residual is not None, QUANT=quantize, BLOCK=block, FP8_MAX=FP8_MAX,
            MIN_SCALE=FP8_MIN_SCALE, num_warps=_num_warps(block), enable_fp_fusion=False)
    return ((q, s) if quantize else y), res_out


def silu_mul_quant(x: torch.Tensor, x_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [tokens, d], row scales [tokens]) of silu(gate) * up, x [tokens, 2d] = gate | up
    (16-bit, contiguous), each times x_scale (fp32 [tokens]) first when given."""
    _check_rows("x", x)
    rows, width = x.shape
    if width % 2:
        raise ValueError(f"x must be [tokens, 2 * d], got {tuple(x.shape)}")
    _check_row_scale("x_scale", x_scale, rows)
    d = width // 2
    q, s = _outputs(rows, d, x.device)
    if rows:
        block = triton.next_power_of_2(d)
        _silu_mul_quant_kernel[(rows,)](x, x_scale if x_scale is not None else x, q, s, d, X_SCALE=x_scale is not None,
                                        BLOCK=block, FP8_MAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE,
                                        num_warps=_num_warps(block, max_warps=32), enable_fp_fusion=False)
    return q, s


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, row scales fp32 [tokens]) of 16-bit rows x [tokens, K] (contiguous), one scale a row."""
    _check_rows("x", x)
    rows, cols = x.shape
    if cols > MAX_ROW:
        raise ValueError(f"rows of {cols} exceed the supported {MAX_ROW}")
    q, s = _outputs(rows, cols, x.device)
    if rows:
        block = triton.next_power_of_2(cols)
        _quantize_rows_kernel[(rows,)](x, q, s, cols, BLOCK=block, FP8_MAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE,
                                       num_warps=_num_warps(block), enable_fp_fusion=False)
    return q, s
