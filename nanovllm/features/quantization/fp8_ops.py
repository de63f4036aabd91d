"""FP8 (e4m3) linear algebra in plain torch: checkpoint formats, reference quantizers, dispatchers.

Two weight schemes:
- block (Qwen's FP8 checkpoints): W [N, K] float8_e4m3fn with `weight_scale_inv` S
  [ceil(N/128), ceil(K/128)] (fp32, or bf16/fp16 as Qwen's dense checkpoints store it), so that
  W_real[n, k] ~= W[n, k] * S[n // 128, k // 128]. Activations are quantized at run time per token
  in groups of 128 along K: x_real[m, k] ~= x_q[m, k] * s_x[m, k // 128]. N and K need not be
  multiples of 128 (the last block is partial).
- tensor (online quantization of bf16 weights): one fp32 scale per weight, one dynamic fp32 scale
  per activation tensor.

Every quantizer here, and the Triton ones in nanovllm/kernels/fp8_gemm.py bit for bit, computes
    scale = max(amax / 448, FP8_MIN_SCALE)           amax / 448: IEEE fp32 division
    q     = fp8(clamp(x * (1 / scale), -448, 448))   1 / scale: IEEE division; fp32 product;
                                                     round to nearest even into e4m3
A product with the group's reciprocal instead of a division per element keeps the kernels
cheap and is still reproducible. The clamp catches products a rounding above 448 (x = amax) and
is needed anyway: torch's cast to float8_e4m3fn does not saturate (beyond 464 gives NaN).

On CPU the dispatchers run this arithmetic in torch (quantize the activation, dequantize both
operands, fp32 matmul): the production path of CPU engines and the reference of the GPU paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanovllm.kernels.fp8_format import BLOCK, FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE  # noqa: F401 (re-exported)

# F.scaled_mm BlockWise1x128 x BlockWise128x128 (cuBLASLt) serves fp8_block_linear on CUDA for
# M >= this many tokens; None: always the Triton kernel. On the H200 (benchmarks/kernels/
# bench_fp8_gemm.py; BENCHMARKS.md) cuBLASLt is faster from M = 128 on (and rejects M = 1),
# but at M = 300 it missed tests/test_fp8_gemm.py's error bound on some elements: off until
# that is understood.
SCALED_MM_BLOCKWISE_MIN_M: int | None = None

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")


def _check_2d(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")


def _check_block(block) -> tuple[int, int]:
    if len(block) != 2 or any(not isinstance(b, int) or b < 1 for b in block):
        raise ValueError(f"block must be two positive ints, got {block!r}")
    return block[0], block[1]


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    # Tensor / tensor on purpose: torch turns a division by a Python scalar into a product with
    # its (rounded) reciprocal on CUDA, which is not the IEEE division the kernels do.
    return (amax / torch.full_like(amax, FP8_MAX)).clamp_min(FP8_MIN_SCALE)


def _quantize_with_scale(x32: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8(clamp(x32 * (1 / scale))) with `scale` broadcast against the fp32 x32."""
    inv = torch.ones_like(scale) / scale
    return (x32 * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


# ----------------------------------------------------------------------------- reference quantizers


def quantize_per_token_group_torch(x: torch.Tensor, group_size: int = BLOCK,
                                   column_major_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization in groups of `group_size` along the last dim.

    x: [M, K] fp16/bf16/fp32. Returns q [M, K] float8_e4m3fn (contiguous) and scales fp32
    [M, ceil(K / group_size)] (x[m, k] ~= q[m, k] * scales[m, k // group_size]); the last group
    may be partial. With column_major_scales the scales are stored [G, M] and returned as the
    transposed view (stride (1, M)), the layout F.scaled_mm's BlockWise1x128 wants.
    """
    _check_float("x", x)
    _check_2d("x", x)
    if group_size < 1:
        raise ValueError(f"group_size must be positive, got {group_size}")
    m, k = x.shape
    groups = _cdiv(k, group_size)
    xp = F.pad(x.float(), (0, groups * group_size - k)).view(m, groups, group_size)
    scales = _scale_from_amax(xp.abs().amax(dim=2))
    q = _quantize_with_scale(xp, scales[..., None]).view(m, groups * group_size)[:, :k].contiguous()
    if column_major_scales:
        scales = scales.t().contiguous().t()
    return q, scales


def dequantize_per_token_group(q: torch.Tensor, scales: torch.Tensor, group_size: int = BLOCK) -> torch.Tensor:
    """fp32 [M, K]: q[m, k] * scales[m, k // group_size] (the inverse of the quantizer above)."""
    _check_2d("q", q)
    m, k = q.shape
    if tuple(scales.shape) != (m, _cdiv(k, group_size)):
        raise ValueError(f"scales must have shape {(m, _cdiv(k, group_size))}, got {tuple(scales.shape)}")
    return q.float() * scales.float().repeat_interleave(group_size, dim=1)[:, :k]


def quantize_per_tensor_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-tensor quantization: q float8_e4m3fn of x's shape, scale fp32 [1] with
    x ~= q * scale (one scale for the whole tensor)."""
    _check_float("x", x)
    x32 = x.float()
    scale = _scale_from_amax(x32.abs().amax().reshape(1))
    return _quantize_with_scale(x32, scale), scale


# ----------------------------------------------------------------------------- weight formats


def quantize_weight_block_fp8(w: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK),
                              scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen's block-FP8 checkpoint format of a weight w [N, K], or of stacked expert weights
    [E, N, K] (each expert's matrix blocked on its own), fp16/bf16/fp32.

    Returns w_q (w's shape) float8_e4m3fn and scale_inv [(E,) ceil(N/bn), ceil(K/bk)] of
    `scale_dtype`, scale_inv = max(block amax / 448, FP8_MIN_SCALE), partial last blocks
    included. The codes are computed from the scale as stored: with a bf16/fp16 scale rounded
    below amax / 448 the block's largest values saturate at 448 (an error of at most that
    rounding, 2**-9 / 2**-12 relative).
    """
    _check_float("w", w)
    _check_weight_dims("w", w)
    if scale_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"scale_dtype must be float16, bfloat16 or float32, got {scale_dtype}")
    bn, bk = _check_block(block)
    lead, (n, k) = w.shape[:-2], w.shape[-2:]
    nb, kb = _cdiv(n, bn), _cdiv(k, bk)
    wp = F.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n)).view(*lead, nb, bn, kb, bk)
    scale = _scale_from_amax(wp.abs().amax(dim=(-3, -1))).to(scale_dtype)
    q = _quantize_with_scale(wp, scale.float()[..., :, None, :, None])
    return q.view(*lead, nb * bn, kb * bk)[..., :n, :k].contiguous(), scale


def dequantize_weight_block_fp8(w_q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK),
                                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W[(e,) n, k] = w_q[(e,) n, k] * scale_inv[(e,) n // bn, k // bk], computed in fp32,
    returned in `dtype`; w_q [N, K] or stacked experts [E, N, K].

    Blocks are indexed by n // bn, not by sizing them as N / scale rows (which is wrong for a
    partial last block)."""
    bn, bk = _check_block(block)
    _check_weight_dims("w_q", w_q)
    lead, (n, k) = w_q.shape[:-2], w_q.shape[-2:]
    _check_scale_shape("scale_inv", scale_inv, (*lead, _cdiv(n, bn), _cdiv(k, bk)))
    s = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (w_q.float() * s).to(dtype)


def quantize_weight_per_tensor_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online FP8 of a weight w [N, K]: w_q [N, K] float8_e4m3fn (row-major, so w_q.t() is the
    column-major operand cuBLASLt wants) and its fp32 scale [1], w ~= w_q * scale."""
    _check_2d("w", w)
    w_q, scale = quantize_per_tensor_torch(w)
    return w_q.contiguous(), scale


def _check_scale_shape(name: str, s: torch.Tensor, shape: tuple[int, ...]) -> None:
    if s.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {s.dtype}")
    if tuple(s.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} ((E,) ceil(N/128), ceil(K/128)), got {tuple(s.shape)}")


def _check_weight_dims(name: str, t: torch.Tensor) -> None:
    if t.dim() not in (2, 3):
        raise ValueError(f"{name} must be 2-D [N, K] or 3-D stacked experts [E, N, K], got shape {tuple(t.shape)}")


# ----------------------------------------------------------------------------- linear dispatchers


def _check_linear(x: torch.Tensor, w_q: torch.Tensor, bias: torch.Tensor | None) -> None:
    _check_float("x", x)
    if w_q.dtype != FP8_DTYPE:
        raise ValueError(f"w_q must be float8_e4m3fn, got {w_q.dtype}")
    _check_2d("w_q", w_q)
    if x.dim() < 1 or x.shape[-1] != w_q.shape[1]:
        raise ValueError(f"x's last dim must be K = {w_q.shape[1]}, got shape {tuple(x.shape)}")
    if bias is not None:
        _check_float("bias", bias)
        if tuple(bias.shape) != (w_q.shape[0],):
            raise ValueError(f"bias must have shape ({w_q.shape[0]},), got {tuple(bias.shape)}")
    devices = {t.device for t in (x, w_q, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"x, w_q and bias must be on one device, got {sorted(map(str, devices))}")


def fp8_block_linear(x: torch.Tensor, w_q: torch.Tensor, scale_inv: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) for a block-FP8 weight (w_q [N, K] e4m3, scale_inv [ceil(N/128),
    ceil(K/128)]), the activation x [..., K] quantized per token in groups of 128. y [..., N] in
    x's dtype.

    CUDA: Triton quantizer + Triton `fp8_block_matmul` (F.scaled_mm blockwise from
    SCALED_MM_BLOCKWISE_MIN_M tokens on). Elsewhere: the torch reference arithmetic.
    """
    _check_linear(x, w_q, bias)
    n, k = w_q.shape
    _check_scale_shape("scale_inv", scale_inv, (_cdiv(n, BLOCK), _cdiv(k, BLOCK)))
    x2 = x.reshape(-1, k)
    if x.device.type == "cuda":
        y = _block_linear_cuda(x2, w_q, scale_inv, bias)
    else:
        q, s = quantize_per_token_group_torch(x2)
        y = dequantize_per_token_group(q, s) @ dequantize_weight_block_fp8(w_q, scale_inv).t()
        if bias is not None:
            y = y + bias.float()
        y = y.to(x.dtype)
    return y.view(*x.shape[:-1], n)


def _block_linear_cuda(x2, w_q, scale_inv, bias):
    from nanovllm.kernels.fp8_gemm import fp8_block_matmul, quantize_fp8_per_token_group

    m, k = x2.shape
    n = w_q.shape[0]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    # cuBLASLt wants whole 128 blocks, and K / 128 a multiple of 4 keeps its weight-scale layout
    # the plain transpose (padding rules for other K differ between torch releases).
    if SCALED_MM_BLOCKWISE_MIN_M is not None and m >= SCALED_MM_BLOCKWISE_MIN_M and k % 512 == 0 and n % 128 == 0:
        q, s = quantize_fp8_per_token_group(x2, BLOCK, column_major_scales=True)
        y = scaled_mm_blockwise(q, s, w_q, scale_inv, x2.dtype)
        return y if bias is None else y.add_(bias)
    q, s = quantize_fp8_per_token_group(x2, BLOCK)
    return fp8_block_matmul(q, s, w_q, scale_inv, x2.dtype, bias)


def scaled_mm_blockwise(a_q: torch.Tensor, a_scales: torch.Tensor, w_q: torch.Tensor, w_scales: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """a @ W^T by F.scaled_mm (cuBLASLt, sm90 only) with BlockWise1x128 activation scales a_scales
    [M, K/128] stored outer-dim-major (stride (1, M)) and BlockWise128x128 weight scales w_scales
    [N/128, K/128] (any float dtype; passed as the transpose of an fp32 contiguous copy). Needs
    K a multiple of 512 and N of 128 here; cuBLASLt refuses some M (M = 1 on the H200)."""
    ws = w_scales.to(torch.float32).contiguous()
    return F.scaled_mm(a_q, w_q.t(), a_scales, F.ScalingType.BlockWise1x128, ws.t(),
                       F.ScalingType.BlockWise128x128, output_dtype=out_dtype)


def fp8_tensor_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) for a per-tensor FP8 weight (w_q [N, K] e4m3 row-major, w_scale fp32
    with one element), x [..., K] quantized per tensor on the fly. y [..., N] in x's dtype.

    CUDA: `quantize_fp8_per_tensor` + torch._scaled_mm tensor-wise (K and N multiples of 16,
    cuBLASLt's rule). Elsewhere: the torch reference arithmetic.
    """
    _check_linear(x, w_q, bias)
    if w_scale.dtype != torch.float32 or w_scale.numel() != 1:
        raise ValueError(f"w_scale must be one float32 element, got {w_scale.dtype} of shape {tuple(w_scale.shape)}")
    n, k = w_q.shape
    x2 = x.reshape(-1, k)
    if x.device.type == "cuda":
        y = _tensor_linear_cuda(x2, w_q, w_scale.reshape(1), bias)
    else:
        q, s = quantize_per_tensor_torch(x2)
        y = (q.float() * s) @ (w_q.float() * w_scale.float().reshape(1)).t()
        if bias is not None:
            y = y + bias.float()
        y = y.to(x.dtype)
    return y.view(*x.shape[:-1], n)


def _tensor_linear_cuda(x2, w_q, w_scale, bias):
    from nanovllm.kernels.fp8_gemm import quantize_fp8_per_tensor

    n, k = w_q.shape
    if k % 16 or n % 16:
        raise ValueError(f"torch._scaled_mm needs K and N multiples of 16, got K={k}, N={n}")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q, s = quantize_fp8_per_tensor(x2)
    # cuBLASLt's bias epilogue takes a bias of the output dtype, and none for fp32 output.
    fuse_bias = bias is not None and x2.dtype != torch.float32
    y = torch._scaled_mm(q, w_q.t(), s, w_scale, bias=bias.to(x2.dtype) if fuse_bias else None, out_dtype=x2.dtype)
    if bias is not None and not fuse_bias:
        y = y + bias
    return y
