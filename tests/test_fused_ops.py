"""Tests for the fused Triton ops (RMSNorm(+residual), q/k norm + RoPE, SiLU*mul).

References are the plain-torch layers of nanovllm/layers (RMSNorm, RotaryEmbedding,
activation.silu_and_mul), which the kernels must reproduce rounding for rounding. Without CUDA the kernels
run through Triton's interpreter (tests/conftest.py), so CPU shapes are tiny and only fp32 /
fp16 are tested there: the interpreter truncates fp32 -> bf16 instead of rounding to nearest.
The `gpu` tests use bf16 and real Qwen3 sizes. Every run draws new random inputs (the seed is
printed), and every buffer the wrappers allocate is pre-filled with NaN, so an element a
kernel forgets to write shows up.
"""

from __future__ import annotations

import random

import pytest
import torch

from nanovllm.kernels.fused_ops import rms_norm, silu_and_mul
from nanovllm.kernels.qk_norm_rope import qk_norm_rope
from nanovllm.model.layers.activation import silu_and_mul as silu_and_mul_ref
from nanovllm.model.layers.layernorm import RMSNorm
from nanovllm.model.layers.rotary_embedding import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]
# Per dtype (rtol, atol): about one unit in the last place at the magnitudes these tests produce.
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2**-10, 2**-9),
    torch.bfloat16: (2**-7, 2**-6),
}
EPS = 1e-6


pytestmark = pytest.mark.usefixtures("fresh_seed", "poisoned_outputs")  # tests/conftest.py


def assert_matches(out: torch.Tensor, ref: torch.Tensor, min_exact: float = 0.98) -> None:
    """Same shape/dtype, all finite, within ~1 ulp; in 16-bit dtypes almost all bit-identical.

    fp32 results differ from torch in the last bits (reduction order, rsqrt/exp), which may
    flip a rounding to 16 bits now and then, but never often.
    """
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "non-finite output (an element left unwritten?)"
    rtol, atol = TOL[out.dtype]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    if out.dtype != torch.float32:
        exact = (out == ref).double().mean().item()
        assert exact >= min_exact, f"only {exact:.4f} of the elements are bit-identical"


def make_rms_norm(hidden: int, dtype, device) -> RMSNorm:
    norm = RMSNorm(hidden, eps=EPS).to(device)
    # Weights away from 1 so the low-precision weight product is exercised.
    norm.weight.data = (1 + 0.2 * torch.randn(hidden, device=device)).to(dtype)
    return norm


def ref_qk_norm_rope(qkv, q_norm, k_norm, rotary, positions, num_heads, num_kv_heads, head_dim):
    """What Qwen3Attention.forward does between qkv_proj and attention."""
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q_norm(q.reshape(-1, num_heads, head_dim))
    k = k_norm(k.reshape(-1, num_kv_heads, head_dim))
    q, k = rotary(positions, q, k)
    return q, k, v.reshape(-1, num_kv_heads, head_dim)


# ----------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("hidden", [1, 72, 1000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, hidden, with_residual):
    rows = random.randint(1, 5)
    norm = make_rms_norm(hidden, dtype, DEVICE)
    x = (3 * torch.randn(rows, hidden, device=DEVICE)).to(dtype)
    if not with_residual:
        assert_matches(rms_norm(x, norm.weight, EPS), norm(x))
        return
    residual = torch.randn(rows, hidden, device=DEVICE).to(dtype)
    y, new_residual = rms_norm(x, norm.weight, EPS, residual)
    y_ref, res_ref = norm(x, residual)
    assert torch.equal(new_residual, res_ref)  # one rounded add: always exact
    assert_matches(y, y_ref)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_adds_a_peers_partial_sum_first(dtype, with_residual):
    """addend: what a two-rank all-reduce would sum, (x + addend) rounded, then as before."""
    rows, hidden = random.randint(1, 5), 72
    norm = make_rms_norm(hidden, dtype, DEVICE)
    x, addend = ((3 * torch.randn(rows, hidden, device=DEVICE)).to(dtype) for _ in range(2))
    summed = (x.float() + addend.float()).to(dtype)
    if not with_residual:
        assert_matches(rms_norm(x, norm.weight, EPS, addend=addend), norm(summed))
        return
    residual = torch.randn(rows, hidden, device=DEVICE).to(dtype)
    y, new_residual = rms_norm(x, norm.weight, EPS, residual, addend=addend)
    y_ref, res_ref = norm(summed, residual)
    assert torch.equal(new_residual, res_ref)
    assert_matches(y, y_ref)
    with pytest.raises(ValueError, match="addend"):
        rms_norm(x, norm.weight, EPS, residual, addend=addend[:, :-1])


def test_rms_norm_strided_rows_and_leading_dims():
    hidden = 40
    norm = make_rms_norm(hidden, torch.float16, DEVICE)
    # Rows of a wider buffer (as a split of a packed projection gives) and their residual.
    wide = torch.randn(3, 2 * hidden + 8, device=DEVICE).half()
    x, res = wide[:, :hidden], wide[:, hidden + 8:]
    y, new_res = rms_norm(x, norm.weight, EPS, res)
    y_ref, res_ref = norm(x, res)
    assert y.is_contiguous() and new_res.is_contiguous()
    assert torch.equal(new_res, res_ref)
    assert_matches(y, y_ref)
    # [tokens, heads, dim] normalises each head, like RMSNorm on a 3-D tensor.
    x3 = torch.randn(2, 3, hidden, device=DEVICE).half()
    assert_matches(rms_norm(x3, norm.weight, EPS), norm(x3))


def test_rms_norm_no_rows():
    w = torch.ones(16, device=DEVICE)
    assert rms_norm(torch.empty(0, 16, device=DEVICE), w, EPS).shape == (0, 16)
    y, r = rms_norm(torch.empty(0, 16, device=DEVICE), w, EPS, torch.empty(0, 16, device=DEVICE))
    assert y.shape == r.shape == (0, 16)


def test_rms_norm_rejects_bad_arguments():
    x = torch.randn(2, 8, device=DEVICE)
    w = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, torch.ones(7, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm(x, w.half(), EPS)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        rms_norm(x.long(), w, EPS)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, w, EPS, torch.randn(3, 8, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous last"):
        rms_norm(torch.randn(8, 2, device=DEVICE).t(), w, EPS)
    with pytest.raises(ValueError, match="exceeds"):
        rms_norm(torch.randn(1, 40000, device=DEVICE), torch.ones(40000, device=DEVICE), EPS)


# ----------------------------------------------------------------------------- qk_norm_rope


QK_CONFIGS = [  # (num_heads, num_kv_heads, head_dim, tokens)
    (4, 2, 64, 5),
    (8, 8, 128, 2),
    (6, 3, 64, 3),  # kv heads not a power of two: part of every head block is masked
    (2, 1, 16, 4),
]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,tokens", QK_CONFIGS)
def test_qk_norm_rope_matches_reference(dtype, num_heads, num_kv_heads, head_dim, tokens):
    max_pos = 4096
    rotary = RotaryEmbedding(head_dim, max_pos, 1_000_000.0).to(DEVICE)
    q_norm = make_rms_norm(head_dim, dtype, DEVICE)
    k_norm = make_rms_norm(head_dim, dtype, DEVICE)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    # A row stride wider than the row, as a view into a bigger projection buffer would have.
    buf = (2 * torch.randn(tokens, width + 16, device=DEVICE)).to(dtype)
    qkv = buf[:, :width]
    positions = torch.randint(0, max_pos, (tokens,), device=DEVICE)
    positions[0] = max_pos - 1
    q, k, v = qk_norm_rope(qkv, q_norm.weight, k_norm.weight, rotary.cos_sin, positions,
                           num_heads, num_kv_heads, head_dim, EPS)
    q_ref, k_ref, v_ref = ref_qk_norm_rope(qkv, q_norm, k_norm, rotary, positions, num_heads,
                                           num_kv_heads, head_dim)
    assert q.is_contiguous() and k.is_contiguous()
    assert_matches(q, q_ref)
    assert_matches(k, k_ref)
    assert torch.equal(v, v_ref)
    # v is a view into qkv, not a copy.
    assert v.data_ptr() == qkv.data_ptr() + (num_heads + num_kv_heads) * head_dim * qkv.element_size()
    assert v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,tokens", QK_CONFIGS)
def test_rope_without_norm_matches_reference(dtype, num_heads, num_kv_heads, head_dim, tokens):
    """q_weight = k_weight = None (Qwen2, Llama): RotaryEmbedding alone, with llama3 scaling."""
    from nanovllm.model.rope_scaling import Llama3RopeScaling

    max_pos = 4096
    rotary = RotaryEmbedding(head_dim, max_pos, 500_000.0, Llama3RopeScaling(8.0, 1.0, 4.0, 1024)).to(DEVICE)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    buf = (2 * torch.randn(tokens, width + 8, device=DEVICE)).to(dtype)
    qkv = buf[:, :width]
    positions = torch.randint(0, max_pos, (tokens,), device=DEVICE)
    positions[0] = max_pos - 1
    q, k, v = qk_norm_rope(qkv, None, None, rotary.cos_sin, positions, num_heads, num_kv_heads, head_dim, EPS)
    q_ref, k_ref = rotary(positions, qkv[:, :num_heads * head_dim].reshape(-1, num_heads, head_dim),
                          qkv[:, num_heads * head_dim:width - num_kv_heads * head_dim].reshape(-1, num_kv_heads,
                                                                                             head_dim))
    assert_matches(q, q_ref)
    assert_matches(k, k_ref)
    assert torch.equal(v, qkv[:, width - num_kv_heads * head_dim:].reshape(-1, num_kv_heads, head_dim))
    with pytest.raises(ValueError, match="both be given"):
        qk_norm_rope(qkv, None, torch.ones(head_dim, device=DEVICE, dtype=dtype), rotary.cos_sin, positions,
                     num_heads, num_kv_heads, head_dim, EPS)


def test_qk_norm_rope_int32_positions_and_no_tokens():
    nh, nkv, d = 2, 1, 32
    rotary = RotaryEmbedding(d, 64, 10_000.0).to(DEVICE)
    w = torch.ones(d, device=DEVICE)
    qkv = torch.randn(3, (nh + 2 * nkv) * d, device=DEVICE)
    pos64 = torch.tensor([63, 0, 17], device=DEVICE)
    a = qk_norm_rope(qkv, w, w, rotary.cos_sin, pos64, nh, nkv, d, EPS)
    b = qk_norm_rope(qkv, w, w, rotary.cos_sin, pos64.int(), nh, nkv, d, EPS)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    q, k, v = qk_norm_rope(qkv[:0], w, w, rotary.cos_sin, pos64[:0], nh, nkv, d, EPS)
    assert q.shape == (0, nh, d) and k.shape == v.shape == (0, nkv, d)


def test_qk_norm_rope_rejects_bad_arguments():
    nh, nkv, d = 2, 1, 32
    cos_sin = RotaryEmbedding(d, 16, 10_000.0).cos_sin.to(DEVICE)
    w = torch.ones(d, device=DEVICE)
    qkv = torch.randn(3, (nh + 2 * nkv) * d, device=DEVICE)
    pos = torch.zeros(3, dtype=torch.long, device=DEVICE)

    def call(**kw):
        args = dict(qkv=qkv, q_weight=w, k_weight=w, cos_sin=cos_sin, positions=pos, num_heads=nh,
                    num_kv_heads=nkv, head_dim=d, eps=EPS)
        args.update(kw)
        return qk_norm_rope(**args)

    with pytest.raises(ValueError, match="power of two"):
        call(qkv=torch.randn(3, 4 * 48, device=DEVICE), q_weight=torch.ones(48, device=DEVICE),
             k_weight=torch.ones(48, device=DEVICE),
             head_dim=48)
    with pytest.raises(ValueError, match="qkv must be"):
        call(qkv=qkv[:, :-1])
    with pytest.raises(ValueError, match="num_kv_heads"):
        call(num_kv_heads=0)
    with pytest.raises(ValueError, match="k_weight"):
        call(k_weight=w.half())
    with pytest.raises(ValueError, match="cos_sin"):
        call(cos_sin=cos_sin.half())
    with pytest.raises(ValueError, match="cos_sin"):
        call(cos_sin=cos_sin.squeeze(1))
    with pytest.raises(ValueError, match="positions must be"):
        call(positions=pos[:2])
    with pytest.raises(ValueError, match="int32 or int64"):
        call(positions=pos.float())


# ----------------------------------------------------------------------------- silu_and_mul


# The interpreter evaluates exp in numpy, which warns where exp(-x) overflows (on purpose here).
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("d", [1, 300, 1500])  # 1500: more than one column block per row
def test_silu_and_mul_matches_reference(dtype, d):
    rows = random.randint(1, 4)
    x = (4 * torch.randn(rows, 2 * d, device=DEVICE)).to(dtype)
    x[0, 0] = -100.0  # exp(-x) overflows: silu must still come out as -0
    assert_matches(silu_and_mul(x), silu_and_mul_ref(x))


def test_silu_and_mul_strided_rows_and_leading_dims():
    x = torch.randn(3, 2, 2 * 24, device=DEVICE).half()
    assert_matches(silu_and_mul(x), silu_and_mul_ref(x))
    wide = torch.randn(3, 2 * 24 + 5, device=DEVICE).half()
    assert_matches(silu_and_mul(wide[:, : 2 * 24]), silu_and_mul_ref(wide[:, : 2 * 24]))
    assert silu_and_mul(torch.empty(0, 8, device=DEVICE)).shape == (0, 4)


def test_silu_and_mul_rejects_bad_arguments():
    with pytest.raises(ValueError, match="2 \\* d"):
        silu_and_mul(torch.randn(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        silu_and_mul(torch.ones(2, 8, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous last"):
        silu_and_mul(torch.randn(8, 2, device=DEVICE).t())


# ----------------------------------------------------------------------------- GPU (bf16, real sizes)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [1024, 4096])
@pytest.mark.parametrize("rows", [1, 7, 256, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gpu_rms_norm_bf16(hidden, rows, with_residual):
    norm = make_rms_norm(hidden, torch.bfloat16, "cuda")
    x = (3 * torch.randn(rows, hidden, device="cuda")).bfloat16()
    if not with_residual:
        assert_matches(rms_norm(x, norm.weight, EPS), norm(x), min_exact=0.99)
        return
    residual = (3 * torch.randn(rows, hidden, device="cuda")).bfloat16()
    y, new_residual = rms_norm(x, norm.weight, EPS, residual)
    y_ref, res_ref = norm(x, residual)
    assert torch.equal(new_residual, res_ref)
    assert_matches(y, y_ref, min_exact=0.99)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 8), (32, 8)])
@pytest.mark.parametrize("tokens", [1, 3, 256, 4096])
def test_gpu_qk_norm_rope_bf16(num_heads, num_kv_heads, tokens):
    head_dim, max_pos = 128, 40960
    rotary = RotaryEmbedding(head_dim, max_pos, 1_000_000.0).cuda()
    q_norm = make_rms_norm(head_dim, torch.bfloat16, "cuda")
    k_norm = make_rms_norm(head_dim, torch.bfloat16, "cuda")
    qkv = (2 * torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, device="cuda")).bfloat16()
    positions = torch.randint(0, max_pos, (tokens,), device="cuda")
    q, k, v = qk_norm_rope(qkv, q_norm.weight, k_norm.weight, rotary.cos_sin, positions,
                           num_heads, num_kv_heads, head_dim, EPS)
    q_ref, k_ref, v_ref = ref_qk_norm_rope(qkv, q_norm, k_norm, rotary, positions, num_heads,
                                           num_kv_heads, head_dim)
    assert_matches(q, q_ref, min_exact=0.99)
    assert_matches(k, k_ref, min_exact=0.99)
    assert torch.equal(v, v_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv_heads", [(28, 4), (32, 8)])  # Qwen2.5-7B, Llama-3.1-8B
@pytest.mark.parametrize("tokens", [1, 256, 4096])
def test_gpu_rope_without_norm_bf16(num_heads, num_kv_heads, tokens):
    from nanovllm.model.rope_scaling import Llama3RopeScaling

    head_dim, max_pos = 128, 32768
    rotary = RotaryEmbedding(head_dim, max_pos, 500_000.0, Llama3RopeScaling(8.0, 1.0, 4.0, 8192)).cuda()
    qkv = (2 * torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, device="cuda")).bfloat16()
    positions = torch.randint(0, max_pos, (tokens,), device="cuda")
    q, k, v = qk_norm_rope(qkv, None, None, rotary.cos_sin, positions, num_heads, num_kv_heads, head_dim, EPS)
    q_ref, k_ref = rotary(positions, qkv[:, :num_heads * head_dim].reshape(tokens, num_heads, head_dim),
                          qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].reshape(
                              tokens, num_kv_heads, head_dim))
    assert_matches(q, q_ref, min_exact=0.99)
    assert_matches(k, k_ref, min_exact=0.99)
    assert torch.equal(v, qkv[:, (num_heads + num_kv_heads) * head_dim:].reshape(tokens, num_kv_heads, head_dim))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [3072, 12288])
@pytest.mark.parametrize("rows", [1, 256, 4096])
def test_gpu_silu_and_mul_bf16(d, rows):
    x = (4 * torch.randn(rows, 2 * d, device="cuda")).bfloat16()
    assert_matches(silu_and_mul(x), silu_and_mul_ref(x), min_exact=0.99)


@pytest.mark.gpu
def test_gpu_fused_ops_in_cuda_graph():
    """All three ops capture into one CUDA graph and replay on new inputs (no host syncs)."""
    tokens, hidden, nh, nkv, hd, inter = 64, 1024, 16, 8, 128, 3072
    rotary = RotaryEmbedding(hd, 4096, 1_000_000.0).cuda()
    norm = make_rms_norm(hidden, torch.bfloat16, "cuda")
    q_norm = make_rms_norm(hd, torch.bfloat16, "cuda")
    k_norm = make_rms_norm(hd, torch.bfloat16, "cuda")
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    res = torch.randn(tokens, hidden, device="cuda").bfloat16()
    qkv = torch.randn(tokens, (nh + 2 * nkv) * hd, device="cuda").bfloat16()
    pos = torch.randint(0, 4096, (tokens,), device="cuda")
    gate_up = torch.randn(tokens, 2 * inter, device="cuda").bfloat16()

    def run():
        return (*rms_norm(x, norm.weight, EPS, res),
                *qk_norm_rope(qkv, q_norm.weight, k_norm.weight, rotary.cos_sin, pos, nh, nkv, hd, EPS)[:2],
                silu_and_mul(gate_up))

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for t in (x, res, qkv, gate_up):
        t.copy_(torch.randn(t.shape, device="cuda"))
    pos.copy_(torch.randint(0, 4096, (tokens,), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    y_ref, res_ref = norm(x, res)
    q_ref, k_ref, _ = ref_qk_norm_rope(qkv, q_norm, k_norm, rotary, pos, nh, nkv, hd)
    refs = (y_ref, res_ref, q_ref, k_ref, silu_and_mul_ref(gate_up))
    for out, ref in zip(outs, refs):
        assert_matches(out, ref, min_exact=0.99)
