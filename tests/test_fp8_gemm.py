"""Tests for the FP8 GEMM building blocks: nanovllm/kernels/fp8_gemm.py (Triton) and
nanovllm/features/quantization/fp8_ops.py (torch references, checkpoint formats, dispatchers).

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py): small shapes, fp32/fp16
GEMM outputs (the interpreter truncates fp32 -> bf16). Every test draws fresh random inputs (the
seed is printed), and every tensor the wrappers allocate with torch.empty is filled with NaN
first, so an element a kernel forgets to write shows up (as NaN, or 0x7f in float8_e4m3fn).
The `gpu` tests rerun the checks with bf16 at Qwen3-8B sizes.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from nanovllm.kernels.fp8_gemm import fp8_block_matmul, quantize_fp8_per_tensor, quantize_fp8_per_token_group
from nanovllm.features.quantization import fp8_ops
from nanovllm.features.quantization.fp8_ops import (
    FP8_MAX,
    FP8_MIN_SCALE,
    dequantize_per_token_group,
    dequantize_weight_block_fp8,
    fp8_block_linear,
    fp8_tensor_linear,
    quantize_per_tensor_torch,
    quantize_per_token_group_torch,
    quantize_weight_block_fp8,
    quantize_weight_per_tensor_fp8,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from triton_caches import json_without_interpreter  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_seed", "poisoned_outputs")  # tests/conftest.py
FP8 = torch.float8_e4m3fn
U32 = 2.0**-24  # fp32 unit roundoff
UNIT_ROUNDOFF = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-9}  # of the output cast


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def activations(m: int, k: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """Random x [M, K] whose columns span 1e-6..1e3 in magnitude (so groups differ in scale and
    e4m3 subnormals occur), with an all-zero group, signed zeros and large values."""
    x = torch.randn(m, k, device=device) * torch.logspace(-6, 3, k, device=device)[torch.randperm(k, device=device)]
    x[0, : min(k, 128)] = 0.0  # an all-zero group (a whole all-zero row when K <= 128)
    x[-1, :3] = -0.0
    if m > 1 or k > 128:  # a group dominated by one big value (not the zero group)
        x[-1, -1] = 6e4 if dtype == torch.float16 else 3e4
    return x.to(dtype)


def assert_same_bytes(q: torch.Tensor, ref: torch.Tensor) -> None:
    assert q.dtype == ref.dtype == FP8 and q.shape == ref.shape
    diff = q.view(torch.uint8) != ref.view(torch.uint8)
    assert not diff.any(), f"{int(diff.sum())} of {q.numel()} codes differ, first at {diff.nonzero()[0].tolist()}"


def gemm_bound(a: torch.Tensor, w: torch.Tensor, ref: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Elementwise bound on |kernel - ref| for ref = a @ w^T in fp32 from dequantized operands.

    Both sides are fp32 computations of the same real sum of K terms a[m,k] w[n,k] (the kernel
    sums exact e4m3 products per 128-block, then scales and adds the blocks; the reference rounds
    the dequantized factors and products, then sums): first-order error bounds of (K + nb + 131) u
    and (K + 2) u times S = sum_k |a||w| give |diff| <= (2K + 512) u S. The output cast adds its
    unit roundoff times |result|."""
    s = a.abs() @ w.abs().t()
    fp32 = (2 * a.shape[1] + 512) * U32 * s
    return fp32 + UNIT_ROUNDOFF[out_dtype] * (ref.abs() + fp32) + 1e-30


# ----------------------------------------------------------------------------- quantizers


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k", [(1, 128), (1, 40), (5, 300), (3, 1000)])
@pytest.mark.parametrize("column_major", [False, True])
def test_group_quant_matches_torch_bitwise(dtype, m, k, column_major):
    x = activations(m, k, dtype)
    q, s = quantize_fp8_per_token_group(x, 128, column_major_scales=column_major)
    q_ref, s_ref = quantize_per_token_group_torch(x, 128, column_major_scales=column_major)
    assert_same_bytes(q, q_ref)
    assert s.dtype == torch.float32 and s.shape == (m, cdiv(k, 128))
    assert torch.equal(s, s_ref)
    if column_major:  # [G, M] storage seen through its transpose: F.scaled_mm's BlockWise1x128 layout
        assert s.stride() == (1, m) or m == 1
    # An all-zero group gets the floor scale and zero codes, never NaN.
    assert s[0, 0] == torch.tensor(FP8_MIN_SCALE, dtype=torch.float32)
    assert (q[0, : min(k, 128)].float() == 0).all()
    assert torch.isfinite(q.float()).all()


@pytest.mark.parametrize("group_size", [16, 64, 256])
def test_group_quant_other_group_sizes(group_size):
    x = activations(4, 300, torch.float16)
    q, s = quantize_fp8_per_token_group(x, group_size)
    q_ref, s_ref = quantize_per_token_group_torch(x, group_size)
    assert_same_bytes(q, q_ref)
    assert torch.equal(s, s_ref)


def test_reference_quantizer_definition():
    """The torch reference is what fp8_ops' docstring says, checked element by element against
    plain Python arithmetic for one group, and dequantizes within e4m3's rounding."""
    x = activations(2, 256, torch.float32)
    q, s = quantize_per_token_group_torch(x)
    for m, g in [(1, 0), (1, 1)]:
        group = x[m, g * 128:(g + 1) * 128]
        amax = group.abs().max()
        scale = max(torch.div(amax, torch.tensor(448.0)).item(), torch.tensor(FP8_MIN_SCALE).item())
        assert s[m, g].item() == torch.tensor(scale, dtype=torch.float32).item()
        inv = torch.tensor(1.0) / s[m, g]
        want = (group * inv).clamp(-448, 448).to(FP8)
        assert_same_bytes(q[m, g * 128:(g + 1) * 128], want)
    deq = dequantize_per_token_group(q, s)
    assert ((deq - x).abs() <= torch.maximum(x.abs() * 2**-4, s.repeat_interleave(128, 1) * 2**-10) * 1.0001).all()


def test_group_quant_amax_lands_on_448():
    """x * (1/scale) may land a rounding above 448 for x = amax: the clamp must give 448, not NaN."""
    cand = torch.rand(4096) * 1e3 + 1e-3
    scale = (cand / torch.full_like(cand, 448.0))
    over = cand * (torch.ones_like(scale) / scale) > 448.0
    assert over.any(), "no amax value whose product overshoots 448 in this sample"
    amax = cand[over][:8]
    x = torch.zeros(len(amax), 128)
    x[:, 5] = amax
    x[:, 6] = -amax
    x[:, 7] = amax / 3
    q, s = quantize_fp8_per_token_group(x)
    assert_same_bytes(q, quantize_per_token_group_torch(x)[0])
    assert (q[:, 5].float() == 448).all() and (q[:, 6].float() == -448).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k", [(1, 128), (1, 40), (7, 300), (300, 40)])
def test_tensor_quant_matches_torch_bitwise(dtype, m, k):
    x = activations(m, k, dtype)
    q, s = quantize_fp8_per_tensor(x)
    q_ref, s_ref = quantize_per_tensor_torch(x)
    assert_same_bytes(q, q_ref)
    assert s.dtype == torch.float32 and s.shape == (1,)
    assert torch.equal(s, s_ref)


def test_tensor_quant_max_anywhere():
    """The amax slots and the quantize kernel's tiles: the largest value in a later
    tile, in the short last one, and at the first element."""
    for where in [(100, 17), (200, 0), (299, 39), (0, 0)]:
        x = torch.randn(300, 40, dtype=torch.float16)
        x[where] = -300.0
        q, s = quantize_fp8_per_tensor(x)
        q_ref, s_ref = quantize_per_tensor_torch(x)
        assert_same_bytes(q, q_ref)
        assert torch.equal(s, s_ref) and s.item() == (torch.tensor(300.0) / torch.tensor(448.0)).item()


def test_tensor_quant_slots_of_several_tiles_and_nan():
    """The amax slots (quantize_fp8_per_tensor's first kernel): 1,100 rows of 2,048 make 138
    slots of two 4-row tiles each, the largest value in the last tile of a middle slot; a NaN
    anywhere makes the scale NaN, as torch's amax does."""
    x = torch.randn(1100, 2048, dtype=torch.bfloat16)
    x[7 * 8 + 5, 1500] = 500.0  # slot 7, its second tile
    q, s = quantize_fp8_per_tensor(x)
    q_ref, s_ref = quantize_per_tensor_torch(x)
    assert_same_bytes(q, q_ref)
    assert torch.equal(s, s_ref) and s.item() == (torch.tensor(500.0) / torch.tensor(448.0)).item()
    x[900, 3] = float("nan")
    assert quantize_fp8_per_tensor(x)[1].isnan().all() and quantize_per_tensor_torch(x)[1].isnan().all()


def test_tensor_quant_slots_split_along_k():
    """Few rows split K among the amax slots (3 rows of 8,192: eight 1,024-column slots): the
    largest value in a middle slot's columns, then a NaN in the last slot's."""
    x = torch.randn(3, 8192, dtype=torch.float16)
    x[2, 3 * 1024 + 700] = -300.0
    q, s = quantize_fp8_per_tensor(x)
    q_ref, s_ref = quantize_per_tensor_torch(x)
    assert_same_bytes(q, q_ref)
    assert torch.equal(s, s_ref) and s.item() == (torch.tensor(300.0) / torch.tensor(448.0)).item()
    x[0, 8191] = float("nan")
    assert quantize_fp8_per_tensor(x)[1].isnan().all()


def test_tensor_quant_zero_input_and_scale_out():
    x = torch.zeros(3, 64, dtype=torch.float16)
    out = torch.full((1,), float("nan"))
    q, s = quantize_fp8_per_tensor(x, scale_out=out)
    assert s is out and s.item() == torch.tensor(FP8_MIN_SCALE).item()
    assert (q.view(torch.uint8) == 0).all()


# ----------------------------------------------------------------------------- block-scaled GEMM


@pytest.mark.parametrize("m,n,k", [(1, 96, 128), (5, 130, 300), (33, 256, 200), (70, 200, 384)])
@pytest.mark.parametrize("out_dtype,with_bias", [(torch.float32, False), (torch.float16, True), (torch.float32, True)])
def test_block_matmul_matches_dequantized_reference(m, n, k, out_dtype, with_bias):
    x = torch.randn(m, k)
    w = torch.randn(n, k) * 0.05
    w[: min(n, 128), : min(k, 128)] *= 30  # one weight block at a different scale
    a_q, a_s = quantize_per_token_group_torch(x, column_major_scales=m % 2 == 1)  # both scale layouts
    # Qwen's dense checkpoints store bf16 (some fp16) scale_inv; fp32 elsewhere.
    w_q, w_s = quantize_weight_block_fp8(w, scale_dtype={5: torch.bfloat16, 33: torch.float16}.get(m, torch.float32))
    bias = torch.randn(n, dtype=torch.float16) if with_bias else None
    out = fp8_block_matmul(a_q, a_s, w_q, w_s, out_dtype, bias=bias)
    a, wd = dequantize_per_token_group(a_q, a_s), dequantize_weight_block_fp8(w_q, w_s)
    ref = a @ wd.t() + (bias.float() if with_bias else 0)
    assert out.shape == (m, n) and out.dtype == out_dtype
    assert torch.isfinite(out).all()
    err = (out.float() - ref).abs()
    bound = gemm_bound(a, wd, ref, out_dtype)
    assert (err <= bound).all(), f"max err/bound {(err / bound).max():.3g}"


def test_block_matmul_every_config():
    """Each tile config of BLOCK_MATMUL_CONFIGS, forced on a partial-block shape."""
    from nanovllm.kernels.fp8_gemm import BLOCK_MATMUL_CONFIGS

    m, n, k = 20, 200, 260
    a_q, a_s = quantize_per_token_group_torch(torch.randn(m, k))
    w_q, w_s = quantize_weight_block_fp8(torch.randn(n, k))
    a, wd = dequantize_per_token_group(a_q, a_s), dequantize_weight_block_fp8(w_q, w_s)
    ref = a @ wd.t()
    for _, cfg in BLOCK_MATMUL_CONFIGS:
        out = fp8_block_matmul(a_q, a_s, w_q, w_s, torch.float32, config=cfg)
        assert ((out - ref).abs() <= gemm_bound(a, wd, ref, torch.float32)).all(), cfg


# ----------------------------------------------------------------------------- weight formats


def block_loop_scales(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """max(block amax / 448, floor) by slicing each block: an independent reference."""
    n, k = w.shape
    s = torch.empty(cdiv(n, bn), cdiv(k, bk))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            amax = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float().abs().max()
            s[i, j] = torch.clamp(amax / torch.tensor(448.0), min=FP8_MIN_SCALE)
    return s


@pytest.mark.parametrize("n,k", [(256, 384), (130, 200), (1, 5), (300, 129)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_weight_block_round_trip(n, k, scale_dtype):
    w = torch.randn(n, k) * torch.logspace(-4, 1, k)
    if n >= 256:
        w[128:256, :128] = 0.0  # an all-zero block
    w_q, s = quantize_weight_block_fp8(w, scale_dtype=scale_dtype)
    # Qwen's format: e4m3 codes of w's shape, scale_inv [ceil(N/128), ceil(K/128)].
    assert w_q.dtype == FP8 and w_q.shape == (n, k) and w_q.is_contiguous()
    assert s.dtype == scale_dtype and s.shape == (cdiv(n, 128), cdiv(k, 128))
    assert torch.equal(s, block_loop_scales(w, 128, 128).to(scale_dtype))
    deq = dequantize_weight_block_fp8(w_q, s)
    # Per element, with v = |w| / scale: e4m3 (3 mantissa bits, round to nearest) is off by at
    # most 2**-4 v for normal v (>= 2**-6) and by half the subnormal spacing 2**-9, i.e. 2**-10,
    # below. A scale rounded to bf16 below amax/448 saturates the block's largest values at
    # 448 * scale: that excess adds. The fp32 reciprocal and products add a few ulp (1 + 2**-18).
    scale = s.float().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    bound = (torch.maximum(2**-4 * w.abs(), 2**-10 * scale) + (w.abs() - 448 * scale).clamp_min(0)) * (1 + 2**-18)
    assert ((w - deq).abs() <= bound).all()
    if n >= 256:
        assert (deq[128:256, :128] == 0).all() and s[1, 0].float().item() == pytest.approx(FP8_MIN_SCALE, rel=1e-2)


def test_dequantize_indexes_blocks_by_n_div_128():
    """N = 130: scale row 1 covers rows 128-129 only (not rows 65-129, as sizing blocks by
    N / scale rows would give)."""
    w_q = (torch.rand(130, 200) * 10).to(FP8)
    s = torch.rand(2, 2) + 0.5
    deq = dequantize_weight_block_fp8(w_q, s)
    for i, j, rows, cols in [(0, 0, slice(0, 128), slice(0, 128)), (0, 1, slice(0, 128), slice(128, 200)),
                             (1, 0, slice(128, 130), slice(0, 128)), (1, 1, slice(128, 130), slice(128, 200))]:
        assert torch.equal(deq[rows, cols], w_q[rows, cols].float() * s[i, j])


def test_weight_per_tensor():
    w = torch.randn(96, 200, dtype=torch.bfloat16)
    w_q, scale = quantize_weight_per_tensor_fp8(w)
    assert w_q.dtype == FP8 and w_q.shape == (96, 200) and w_q.stride() == (200, 1)
    assert scale.dtype == torch.float32 and scale.shape == (1,)
    assert scale.item() == torch.tensor(w.float().abs().max().item() / 448.0).item()
    err = (w_q.float() * scale - w.float()).abs()
    assert (err <= torch.maximum(2**-4 * w.float().abs(), 2**-10 * scale) * (1 + 2**-18)).all()


# ----------------------------------------------------------------------------- dispatchers (CPU path)


def hand_block_linear(x, w_q, s_w, bias):
    """The block scheme's steps written out with loops: per-group quantization, dequantization,
    fp32 matmul, bias, cast."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k).float()
    a = torch.empty_like(x2)
    for g in range(0, k, 128):
        grp = x2[:, g:g + 128]
        scale = torch.clamp(grp.abs().amax(1, keepdim=True) / torch.full((1, 1), 448.0), min=FP8_MIN_SCALE)
        q = (grp * (torch.ones_like(scale) / scale)).clamp(-448, 448).to(FP8)
        a[:, g:g + 128] = q.float() * scale
    wd = torch.empty(w_q.shape)
    for i in range(0, w_q.shape[0], 128):
        for j in range(0, k, 128):
            wd[i:i + 128, j:j + 128] = w_q[i:i + 128, j:j + 128].float() * s_w[i // 128, j // 128].float()
    y = a @ wd.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], -1)


def hand_tensor_linear(x, w_q, w_s, bias):
    x2 = x.reshape(-1, x.shape[-1]).float()
    scale = torch.clamp(x2.abs().max().reshape(1) / torch.full((1,), 448.0), min=FP8_MIN_SCALE)
    q = (x2 * (torch.ones_like(scale) / scale)).clamp(-448, 448).to(FP8)
    y = (q.float() * scale) @ (w_q.float() * w_s).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], -1)


# Relative Frobenius error of a random GEMM with both operands in e4m3, against x @ w^T in full
# precision: e4m3 rounds each element by up to 2**-4 relative, about 2.6% RMS for randn data;
# independent over k, the two operands' errors add in quadrature: ~3.7% measured (3.3-3.9% over
# the shapes below). Bound with margin for the sampling noise of small outputs.
FULL_PRECISION_REL_ERR = 0.055


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,n", [((2, 3, 300), 130), ((1, 128), 512), ((20, 1024), 256)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_cpu_paths(dtype, shape, n, with_bias):
    k = shape[-1]
    x = torch.randn(shape).to(dtype)
    w = torch.randn(n, k) * 0.05
    bias = torch.randn(n).to(dtype) if with_bias else None
    full = x.float() @ w.t() + (bias.float() if with_bias else 0)

    w_q, s_w = quantize_weight_block_fp8(w)
    y = fp8_block_linear(x, w_q, s_w, bias)
    assert y.shape == (*shape[:-1], n) and y.dtype == dtype
    assert torch.equal(y, hand_block_linear(x, w_q, s_w, bias))
    rel = ((y.float() - full).norm() / (full - (bias.float() if with_bias else 0)).norm()).item()
    assert rel < FULL_PRECISION_REL_ERR

    w_q, w_s = quantize_weight_per_tensor_fp8(w)
    y = fp8_tensor_linear(x, w_q, w_s, bias)
    assert y.shape == (*shape[:-1], n) and y.dtype == dtype
    assert torch.equal(y, hand_tensor_linear(x, w_q, w_s, bias))
    rel = ((y.float() - full).norm() / (full - (bias.float() if with_bias else 0)).norm()).item()
    assert rel < FULL_PRECISION_REL_ERR


def test_block_linear_matches_kernels_composition():
    """The CUDA path's composition (Triton quantizer + Triton GEMM), run here through the
    interpreter, against the CPU path: same codes and scales, fp32 sums within gemm_bound."""
    x = torch.randn(6, 300)
    w_q, s_w = quantize_weight_block_fp8(torch.randn(130, 300))
    q, s = quantize_fp8_per_token_group(x)
    out = fp8_block_matmul(q, s, w_q, s_w, torch.float32)
    a, wd = dequantize_per_token_group(q, s), dequantize_weight_block_fp8(w_q, s_w)
    ref = fp8_block_linear(x, w_q, s_w)
    assert torch.equal(ref, a @ wd.t())
    assert ((out - ref).abs() <= gemm_bound(a, wd, ref, torch.float32)).all()


# ----------------------------------------------------------------------------- bad input


def test_bad_inputs():
    x = torch.randn(4, 256)
    a_q, a_s = quantize_per_token_group_torch(x)
    w_q, w_s = quantize_weight_block_fp8(torch.randn(130, 256))
    cases = [
        (lambda: quantize_fp8_per_token_group(x.to(torch.int32)), "float16, bfloat16 or float32"),
        (lambda: quantize_fp8_per_token_group(x.view(2, 2, 256)), "2-D"),
        (lambda: quantize_fp8_per_token_group(x.t()), "contiguous last dim"),
        (lambda: quantize_fp8_per_token_group(x, group_size=100), "power of two"),
        (lambda: quantize_fp8_per_tensor(x, scale_out=torch.empty(1, dtype=torch.float16)), "scale_out"),
        (lambda: fp8_block_matmul(a_q.float(), a_s, w_q, w_s, torch.float32), "a_q must be float8_e4m3fn"),
        (lambda: fp8_block_matmul(a_q, a_s[:, :1], w_q, w_s, torch.float32), "a_scales must be float32 of shape"),
        (lambda: fp8_block_matmul(a_q, a_s.double(), w_q, w_s, torch.float32), "a_scales must be float32"),
        (lambda: fp8_block_matmul(a_q, a_s, w_q, w_s[:1], torch.float32), "w_scales must be"),
        (lambda: fp8_block_matmul(a_q, a_s, w_q[:, :128], w_s, torch.float32), "disagree on K"),
        (lambda: fp8_block_matmul(a_q, a_s, w_q, w_s, torch.int8), "out_dtype"),
        (lambda: fp8_block_matmul(a_q, a_s, w_q, w_s, torch.float32, bias=torch.zeros(3)), "bias"),
        (lambda: fp8_block_matmul(a_q, a_s, w_q, w_s, torch.float32, block_size=(64, 128)), "block_size"),
        (lambda: fp8_block_matmul(a_q, a_s, w_q, w_s, torch.float32,
                                  config=dict(BLOCK_M=16, BLOCK_N=96, GROUP_M=1, num_warps=4, num_stages=2)),
         "BLOCK_N must divide 128"),
        (lambda: fp8_block_linear(x, w_q.float(), w_s), "w_q must be float8_e4m3fn"),
        (lambda: fp8_block_linear(x, w_q, w_s[:1]), "scale_inv must have shape"),
        (lambda: fp8_block_linear(x[:, :200], w_q, w_s), "last dim must be K"),
        (lambda: fp8_block_linear(x, w_q, w_s, bias=torch.zeros(129)), "bias must have shape"),
        (lambda: fp8_block_linear(x.long(), w_q, w_s), "x must be"),
        (lambda: fp8_tensor_linear(x, w_q, torch.ones(2)), "w_scale must be one float32"),
        (lambda: fp8_tensor_linear(x, w_q, torch.ones(1, dtype=torch.bfloat16)), "w_scale must be one float32"),
        (lambda: quantize_weight_block_fp8(torch.randn(8)), "2-D"),
        (lambda: quantize_weight_block_fp8(torch.randn(8, 8), block=(0, 128)), "block must be"),
        (lambda: quantize_weight_block_fp8(torch.randn(8, 8), scale_dtype=torch.int32), "scale_dtype"),
        (lambda: dequantize_weight_block_fp8(w_q, w_s[:, :1]), "scale_inv must have shape"),
        (lambda: dequantize_per_token_group(a_q, a_s[:, :1]), "scales must have shape"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


# ----------------------------------------------------------------------------- GPU


gpu = pytest.mark.gpu


def gpu_gemm_bound(a: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|gpu - ref| bound for a bf16 GPU GEMM against the fp32 dequantized reference: bf16 output
    rounding (2**-9 |ref|, doubled for margin), plus 2**-12 S (S = sum_k |a||w|) for the tensor
    cores' fp8 accumulation, which keeps fewer bits than fp32 within each 128-block (Triton) or
    between cuBLASLt's promotions."""
    return 2**-8 * ref.abs() + 2**-12 * (a.abs() @ w.abs().t()) + 1e-30


@pytest.fixture
def exact_fp32_matmul():
    """References in true fp32 (no TF32)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@gpu
@pytest.mark.parametrize("m", [1, 64, 300])
@pytest.mark.parametrize("k", [4096, 4000])
def test_gpu_quantizers_bitwise(m, k):
    """On the GPU too the codes and scales match the torch references bit for bit, computed both
    on the GPU and on the CPU: tl.div_rn is IEEE division like torch's tensor / tensor (CUDA and
    CPU), products and sums are IEEE fp32, and the fp8 cast sees exact values."""
    x = activations(m, k, torch.bfloat16, "cuda")
    for column_major in (False, True):
        q, s = quantize_fp8_per_token_group(x, column_major_scales=column_major)
        for dev in ("cuda", "cpu"):
            q_ref, s_ref = quantize_per_token_group_torch(x.to(dev))
            assert_same_bytes(q.to(dev), q_ref)
            assert torch.equal(s.to(dev), s_ref)
    q, s = quantize_fp8_per_tensor(x)
    for dev in ("cuda", "cpu"):
        q_ref, s_ref = quantize_per_tensor_torch(x.to(dev))
        assert_same_bytes(q.to(dev), q_ref)
        assert torch.equal(s.to(dev), s_ref)


@gpu
@pytest.mark.parametrize("m", [1, 64, 300])
@pytest.mark.parametrize("n,k", [(6144, 4096), (1000, 4000)])
def test_gpu_block_linear(m, n, k, exact_fp32_matmul):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w_q, w_s = quantize_weight_block_fp8(torch.randn(n, k, device="cuda") * 0.02, scale_dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for b in (None, bias):
        y = fp8_block_linear(x, w_q, w_s, b)
        assert y.dtype == torch.bfloat16 and y.shape == (m, n) and torch.isfinite(y).all()
        a_q, a_s = quantize_per_token_group_torch(x)
        a, wd = dequantize_per_token_group(a_q, a_s), dequantize_weight_block_fp8(w_q, w_s)
        ref = a @ wd.t() + (0 if b is None else b.float())
        assert ((y.float() - ref).abs() <= gpu_gemm_bound(a, wd, ref)).all()
        # and against the CPU production path (same arithmetic, rounded to bf16 there)
        cpu = fp8_block_linear(x.cpu(), w_q.cpu(), w_s.cpu(), None if b is None else b.cpu())
        assert ((y.float().cpu() - cpu.float()).abs() <= 2 * gpu_gemm_bound(a, wd, ref).cpu()).all()


@gpu
@pytest.mark.parametrize("m", [64, 300])
def test_gpu_block_linear_scaled_mm_path(m, monkeypatch, exact_fp32_matmul):
    """The opt-in F.scaled_mm blockwise path (SCALED_MM_BLOCKWISE_MIN_M): enable it only if this
    passes on the GPU."""
    monkeypatch.setattr(fp8_ops, "SCALED_MM_BLOCKWISE_MIN_M", 2)
    n, k = 6144, 4096
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w_q, w_s = quantize_weight_block_fp8(torch.randn(n, k, device="cuda") * 0.02)
    y = fp8_block_linear(x, w_q, w_s)
    a_q, a_s = quantize_per_token_group_torch(x)
    a, wd = dequantize_per_token_group(a_q, a_s), dequantize_weight_block_fp8(w_q, w_s)
    ref = a @ wd.t()
    assert ((y.float() - ref).abs() <= gpu_gemm_bound(a, wd, ref)).all()


@gpu
@pytest.mark.parametrize("m", [1, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gpu_tensor_linear(m, with_bias, exact_fp32_matmul):
    """torch._scaled_mm tensor-wise against the CPU path's arithmetic (the same codes and scales,
    dequantized, fp32 matmul)."""
    n, k = 6144, 4096
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w_q, w_s = quantize_weight_per_tensor_fp8(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if with_bias else None
    y = fp8_tensor_linear(x, w_q, w_s, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n) and torch.isfinite(y).all()
    q, s = quantize_per_tensor_torch(x)
    a, wd = q.float() * s, w_q.float() * w_s
    ref = a @ wd.t() + (bias.float() if with_bias else 0)
    assert ((y.float() - ref).abs() <= gpu_gemm_bound(a, wd, ref)).all()
    cpu = fp8_tensor_linear(x.cpu(), w_q.cpu(), w_s.cpu(), None if bias is None else bias.cpu())
    assert ((y.float().cpu() - cpu.float()).abs() <= 2 * gpu_gemm_bound(a, wd, ref).cpu()).all()


@gpu
def test_gpu_linears_capture_in_cuda_graph():
    """Both dispatchers run inside a CUDA graph (no host sync), and replays follow new inputs."""
    n, k, m = 1024, 2048, 8
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wb_q, wb_s = quantize_weight_block_fp8(torch.randn(n, k, device="cuda") * 0.02)
    wt_q, wt_s = quantize_weight_per_tensor_fp8(torch.randn(n, k, device="cuda") * 0.02)
    run = lambda: (fp8_block_linear(x, wb_q, wb_s), fp8_tensor_linear(x, wt_q, wt_s))
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    x.copy_(torch.randn_like(x) * 3)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs, run()):
        assert torch.equal(got, want)


_KEYS_BY_K = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from triton_caches import compile_keys
from nanovllm.kernels.fp8_gemm import quantize_fp8_per_tensor
keys = {k: sorted(set().union(*(compile_keys(lambda: quantize_fp8_per_tensor(torch.randn(m, k).to(torch.bfloat16)))
                                 for m in (1, 2, 3, 5, 16, 17, 48, 100, 256, 300, 1024, 1100, 4099, 16384))))
        for k in (1024, 2048, 4096, 12288)}
print(json.dumps({k: [v[0] for v in vs] for k, vs in keys.items()}))
"""


def test_tensor_quant_launches_one_variant_a_k_whatever_the_rows():
    """Prefill and mixed steps quantize inputs of every row count; the variants start-up compiles
    must serve them all (a compile inside a run stalls it). The launches are caught, not run
    (tests/hopper_compile.py, in a process without the interpreter), and their compile keys over
    M = 1 .. 16,384 are one a kernel for each K: the amax slots and their count (which vary with
    M) are neither constexprs nor specialized integers."""
    kernels = json_without_interpreter(_KEYS_BY_K)
    assert sorted(kernels) == ["1024", "12288", "2048", "4096"]
    for k, names in kernels.items():
        assert sorted(names) == ["_amax_parts_kernel", "_quant_tensor_kernel"], (k, names)
