"""Fused elementwise ops of a decoder layer: one Triton kernel per op instead of ~20 tiny torch ops.

- `rms_norm`: RMSNorm, optionally fused with the residual add before it.
- `qk_norm_rope` (q/k RMSNorm + RoPE, and the fused K/V store) lives in qk_norm_rope.py and
  shares this module's conventions.
- `silu_and_mul`: silu(gate) * up of the packed gate_up projection.

Math is fp32, but every intermediate that the plain-torch layers in nanovllm/model/layers round to the
activation dtype is rounded here too, at the same place, so results match those references
(bit-for-bit up to ulp-level differences of rsqrt/exp and of the reduction order). Kernels are
compiled with fp fusion (FMA contraction) off: torch runs each product and sum as a separate
kernel, so it rounds after each of them, and contracting them would shift the rounding.

The wrappers allocate their outputs, validate shapes/dtypes on the host only (no host syncs), and
are CUDA-graph capturable. The layers call them for CUDA tensors only; on CPU the engine keeps
the torch ops, and the kernels run there only through Triton's interpreter, for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Above this one row no longer fits in registers of one program (spills, then failures).
_MAX_HIDDEN = 32768


def _num_warps(elements: int, per_thread: int = 8, max_warps: int = 16) -> int:
    # ~8 elements a thread: 16-byte vector accesses in bf16, and enough warps to hide latency
    # when only a few hundred rows (decode) are in flight.
    return max(1, min(max_warps, triton.next_power_of_2(elements) // (32 * per_thread)))


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")


def _check_same_device(**tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"{', '.join(tensors)} must be on one device, got {sorted(map(str, devices))}")


# ----------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    x_stride,
    add_ptr,
    add_stride,
    res_ptr,
    res_stride,
    w_ptr,
    y_ptr,
    res_out_ptr,
    n_cols,
    eps,
    HAS_ADDEND: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """y[r] = weight * (s * rsqrt(mean(s^2) + eps)) for one row r, with s = x[r] (+ residual[r]).

    One program per row. x / residual rows start at r * stride (last dim contiguous); y and
    res_out are contiguous [rows, n_cols]. BLOCK = next_power_of_2(n_cols), lanes past n_cols
    masked (they load 0, which leaves the sum of squares alone). With HAS_RESIDUAL, s is rounded
    to the dtype (torch adds in the activation dtype) and stored to res_out. The normed row is
    rounded to the dtype before the weight product, and the product is rounded again, as
    transformers' Qwen3RMSNorm does (`weight * normed.to(dtype)`). With HAS_ADDEND, x[r] is first
    replaced by (x[r] + addend[r]) rounded to the dtype (a peer's partial sum: what a two-rank
    all-reduce would have produced).
    """
    row = tl.program_id(0).to(tl.int64)
    dtype = y_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_ADDEND:
        a = tl.load(add_ptr + row * add_stride + offs, mask=mask, other=0.0).to(tl.float32)
        x = (x + a).to(dtype).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(dtype)
        tl.store(res_out_ptr + row * n_cols + offs, s, mask=mask)
        x = s.to(tl.float32)
    tl.store(y_ptr + row * n_cols + offs, _rms_norm_row(x, w_ptr, offs, mask, n_cols, eps, dtype), mask=mask)


@triton.jit
def _rms_norm_row(x, w_ptr, offs, mask, n_cols, eps, dtype: tl.constexpr):
    """weight * (x * rsqrt(mean(x^2) + eps)) of one fp32 row (masked lanes 0), rounded as
    transformers does: the normed row to `dtype`, then the product with the weight."""
    var = tl.sum(x * x, axis=0) / n_cols
    normed = (x * tl.rsqrt(var + eps)).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # Both factors are exact in fp32 and their product fits in its mantissa (bf16/fp16), so
    # rounding it once to the dtype equals torch's low-precision multiply.
    return (normed * w).to(dtype)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    addend: torch.Tensor | None = None,
):
    """RMSNorm over the last dim of x: `y` or, with `residual`, `(y, x + residual)`.

    x: [..., hidden] float16/bfloat16/float32 with stride(-1) == 1 (2-D row views with any
    row stride are used as is; other layouts are flattened with reshape). weight: [hidden],
    same dtype. residual: same shape and dtype as x. Without residual y = norm(x); with it
    s = (x + residual) rounded to the dtype and the result is (norm(s), s). Outputs are new
    contiguous tensors of x's shape and dtype. hidden <= 32768. `addend` (like residual): x is
    replaced by (x + addend) rounded to the dtype first, e.g. to finish a two-rank all-reduce.
    """
    _check_float("x", x)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must be [..., hidden] with hidden > 0, got {tuple(x.shape)}")
    hidden = x.shape[-1]
    if hidden > _MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} exceeds the supported {_MAX_HIDDEN}")
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    if x.stride(-1) != 1:
        raise ValueError("x needs a contiguous last dimension (stride(-1) == 1)")
    tensors = {"x": x, "weight": weight}
    for name, t in (("residual", residual), ("addend", addend)):
        if t is None:
            continue
        if t.shape != x.shape or t.dtype != x.dtype:
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} must match x {tuple(x.shape)} {x.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension (stride(-1) == 1)")
        tensors[name] = t
    _check_same_device(**tensors)

    x2 = x.reshape(-1, hidden)
    rows = x2.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(y) if residual is not None else None
    if rows > 0:
        weight = weight.contiguous()
        r2 = residual.reshape(-1, hidden) if residual is not None else x2
        a2 = addend.reshape(-1, hidden) if addend is not None else x2
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x2, x2.stride(0), a2, a2.stride(0), r2, r2.stride(0), weight, y,
            res_out if res_out is not None else y,  # unused without a residual
            hidden, float(eps), HAS_ADDEND=addend is not None, HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=_num_warps(block), enable_fp_fusion=False,
        )
    return y if residual is None else (y, res_out)


# ----------------------------------------------------------------------------- norms across GEMVs
# The batch-1 GEMVs (dense_gemv.py, w4a16_gemv.py) fold each RMSNorm into their neighbours
# (model/norm_chain.py): the GEMV before it adds the residual and writes the new residual stream s,
# s times the norm's weight (rounded to the dtype) and each program's sum of s^2; the GEMV after it
# multiplies that product and scales each output by rsqrt(mean(s^2) + eps), made from those sums.


@triton.jit
def store_residual_sum(out_ptr, ss_ptr, y, r_ptr, offs, mask, nw_ptr, scaled_ptr, NORM_OUT: tl.constexpr,
                       dtype: tl.constexpr):
    """out = y + residual (each rounded to the dtype, as torch adds 16-bit tensors), this
    program's sum of its squares at ss[program], and with NORM_OUT scaled = out * norm weight
    (one rounding: both factors exact in fp32, their product fits its mantissa)."""
    s = (y.to(dtype).to(tl.float32) + tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    tl.store(out_ptr + offs, s, mask=mask)
    sf = tl.where(mask, s.to(tl.float32), 0.0)
    tl.store(ss_ptr + tl.program_id(0), tl.sum(sf * sf, axis=0))
    if NORM_OUT:
        w = tl.load(nw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(scaled_ptr + offs, (sf * w).to(dtype), mask=mask)


def check_norm_fold(n: int, add_residual, next_norm_weight, norm_parts) -> None:
    """The fold's operands as a GEMV of N outputs takes them (ValueError naming the one that does
    not fit): add_residual [1, N]; next_norm_weight [N], only with add_residual; norm_parts, the
    fp32 [programs] sums add_residual returned, never with add_residual (one GEMV does either)."""
    if add_residual is not None and add_residual.shape != (1, n):
        raise ValueError(f"add_residual must be [1, {n}], got {tuple(add_residual.shape)}")
    if next_norm_weight is not None and (add_residual is None or next_norm_weight.shape != (n,)):
        raise ValueError(f"next_norm_weight must be [{n}] and comes with add_residual")
    if norm_parts is not None and (add_residual is not None or norm_parts.dim() != 1
                                   or norm_parts.dtype != torch.float32):
        raise ValueError("norm_parts takes the fp32 [programs] sums add_residual returned (and no add_residual)")


@triton.jit
def inv_rms_parts(ss_ptr, parts, K, eps):
    """rsqrt(mean(s^2) + eps) from the per-program sums of squares store_residual_sum wrote (every
    program adds them in the same order, so all use the same value)."""
    offs = tl.arange(0, 256)
    acc = tl.zeros([256], dtype=tl.float32)
    for p0 in range(0, parts, 256):
        acc += tl.load(ss_ptr + p0 + offs, mask=p0 + offs < parts, other=0.0)
    return tl.rsqrt(tl.sum(acc, axis=0) / K + eps)


@triton.jit
def _norm_parts_kernel(x_ptr, w_ptr, scaled_ptr, ss_ptr, n_cols, BLOCK: tl.constexpr):
    """For one row s: its sum of squares at ss[0] and s * weight (store_residual_sum's, no add)."""
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ss_ptr, tl.sum(x * x, axis=0))
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(scaled_ptr + offs, (x * w).to(scaled_ptr.dtype.element_ty), mask=mask)


def norm_parts(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of squares [1] fp32, x * weight [1, H]) of one 16-bit row x [1, H]: what the GEMV after
    a norm takes (model/norm_chain.py's first layer, from the embedding), in one launch."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"x must be 16-bit (bf16 / fp16), got {x.dtype}")
    if x.dim() != 2 or x.shape[0] != 1 or not 0 < x.shape[1] <= _MAX_HIDDEN or not x.is_contiguous():
        raise ValueError(f"x must be one contiguous row [1, H <= {_MAX_HIDDEN}], got {tuple(x.shape)}")
    if weight.shape != (x.shape[1],) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{x.shape[1]}] {x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    _check_same_device(x=x, weight=weight)
    parts = torch.empty(1, dtype=torch.float32, device=x.device)
    scaled = torch.empty_like(x)
    block = triton.next_power_of_2(x.shape[1])
    _norm_parts_kernel[(1,)](x, weight.contiguous(), scaled, parts, x.shape[1], BLOCK=block,
                             num_warps=_num_warps(block), enable_fp_fusion=False)
    return parts, scaled


# ----------------------------------------------------------------------------- SiLU * mul


@triton.jit
def silu_mul_rounded(gate, up, dtype: tl.constexpr):
    """silu(gate) * up from fp32 values, in `dtype`, rounded where torch's layers round: silu to
    the dtype, then the product (also the batch-1 GEMVs' SiLU epilogue, so both paths agree).
    exp(-gate) overflowing to inf for very negative gate gives gate / inf = -0: correct limit."""
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, x_stride, y_ptr, d, BLOCK: tl.constexpr):
    """y[r, c] = silu(x[r, c]) * x[r, d + c] for one row r and BLOCK columns c.

    Grid (rows, cdiv(d, BLOCK)); x rows start at r * x_stride (stride(-1) == 1), y is
    contiguous [rows, d]. silu is computed in fp32 and rounded to the dtype, then the
    product is rounded again: what `F.silu(gate) * up` does in bf16/fp16.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    dtype = y_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * d + cols, silu_mul_rounded(gate, up, dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for x [..., 2 * d]: a new contiguous [..., d] tensor.

    x: float16/bfloat16/float32 with stride(-1) == 1 (2-D row views with any row stride are
    used as is; other layouts are flattened with reshape). Rounds as SiluAndMul does.
    """
    _check_float("x", x)
    if x.dim() < 1 or x.shape[-1] == 0 or x.shape[-1] % 2:
        raise ValueError(f"x must be [..., 2 * d] with d > 0, got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError("x needs a contiguous last dimension (stride(-1) == 1)")
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    y = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows > 0:
        block = min(triton.next_power_of_2(d), 1024)
        _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](
            x2, x2.stride(0), y, d, BLOCK=block, num_warps=_num_warps(block, max_warps=8), enable_fp_fusion=False,
        )
    return y
