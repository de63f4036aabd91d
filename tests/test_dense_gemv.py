"""The batch-1 dense GEMV (kernels/dense_gemv.py) against torch.

Without CUDA the kernel runs in Triton's interpreter (tests/conftest.py) in fp16: the interpreter
truncates fp32 -> bf16 instead of rounding to nearest, fp16 it rounds as the GPU does. The GEMV
sums the same products as torch in another order (fp32), then rounds once to 16 bits, so each
output is within one 16-bit ulp of the fp32 reference (the fp32 reordering error, ~K * 2^-24 of
the sum of |products|, is far below that at these sizes). What is folded in (the SiLU epilogue,
the RMSNorm prologue) must round exactly as the separate kernels do: fused equals unfused bit for
bit (same x, same order of the sums), and the new residual equals torch's rounded add. The norm
split across two GEMVs (add_residual + NORM_PARTS) rounds its inputs once where the norm kernel
rounds twice: bounded by one_rounding_apart.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from nanovllm.kernels.dense_gemv import Prologue, Tile, dense_gemv

sys.path.insert(0, os.path.dirname(__file__))

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float16
FP8 = torch.float8_e4m3fn
EPS = 1e-6
# (N, K, tile): K a multiple of the tile, K not (masked tail), rows not a multiple of BLOCK_N.
SHAPES = [(40, 64, Tile(8, 32, 4)), (33, 96, Tile(4, 64, 4)), (24, 80, Tile(8, 64, 4)), (64, 256, None)]


MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}


def ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One ulp of `dtype` at |t| (at least its smallest normal's)."""
    mag = t.abs().clamp_min(torch.finfo(dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - MANTISSA_BITS[dtype])


def weights(n: int, k: int, fp8: bool, gen: torch.Generator):
    """(weight as the kernel reads it, its scale or None, the same weight in fp32)."""
    w = torch.randn(n, k, generator=gen) * 0.1
    if not fp8:
        w = w.to(DTYPE)
        return w.to(DEVICE), None, w.float()
    scale = torch.tensor([0.02 + torch.rand(1, generator=gen).item() * 0.01])
    q = (w / scale).to(FP8)
    return q.to(DEVICE), scale.to(DEVICE), q.float() * scale


def one_rounding_apart(x: torch.Tensor, w32: torch.Tensor) -> torch.Tensor:
    """How far x @ w32^T may move when each input is rounded once here and twice there (the
    norm folded into the GEMVs against the norm kernel): 3 units of roundoff of each |input| x
    |weight| product, summed (no cancellation assumed), for each output."""
    return 3 * 2.0 ** -(MANTISSA_BITS[DTYPE] + 1) * (x.abs() @ w32.abs().t())


def close(out: torch.Tensor, ref32: torch.Tensor) -> None:
    err = (out.float().cpu() - ref32).abs()
    bound = ulp(ref32, DTYPE) + 1e-6 * ref32.abs().max()
    assert out.dtype == DTYPE and torch.isfinite(out).all()
    assert (err <= bound).all(), (err - bound).max()


def rms_normed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen3RMSNorm in the 16-bit dtype: fp32 statistics, two roundings."""
    v = x.float()
    return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * weight


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("n, k, tile", SHAPES)
def test_plain_equals_torch(n, k, tile, fp8):
    gen = torch.Generator().manual_seed(n * k + fp8)
    w, scale, w32 = weights(n, k, fp8, gen)
    x = torch.randn(1, k, generator=gen).to(DTYPE)
    bias = torch.randn(n, generator=gen).to(DTYPE)
    out = dense_gemv(x.to(DEVICE), w, scale=scale, bias=bias.to(DEVICE), tile=tile)
    close(out, x.float() @ w32.t() + bias.float())


@pytest.mark.parametrize("n, k, tile", [(300, 260, Tile(4, 128, 4)), (256, 384, None), (130, 512, Tile(2, 256, 4))])
def test_block_fp8_equals_torch(n, k, tile):
    """128 x 128 block scales (partial last blocks both ways), applied to x inside the GEMV."""
    from nanovllm.features.quantization.fp8_ops import dequantize_weight_block_fp8, quantize_weight_block_fp8

    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 0.2
    q, scale_inv = quantize_weight_block_fp8(w)
    x = (torch.randn(1, k, generator=gen) * 2).to(DTYPE)
    out = dense_gemv(x.to(DEVICE), q.to(DEVICE), scale=scale_inv.to(DEVICE), tile=tile)
    # x * scale rounds once more in fp32 than torch's order: ~2^-24 relative, inside the bound.
    close(out, x.float() @ dequantize_weight_block_fp8(q, scale_inv).t())


def _fp8_blocks(w: torch.Tensor):
    from nanovllm.features.quantization.fp8_ops import quantize_weight_block_fp8

    q, scale_inv = quantize_weight_block_fp8(w)
    return q.to(DEVICE), scale_inv.to(DEVICE)


@pytest.mark.parametrize("weights_kind", ["16-bit", "fp8", "fp8-blocks"])
@pytest.mark.parametrize("n, k, tile", SHAPES + [(256, 300, Tile(4, 128, 4))])
def test_silu_epilogue_equals_the_separate_kernel(n, k, tile, weights_kind):
    """gate_up's GEMV writing silu(gate) * up (rows r and n + r of a [2n, K] weight in one
    program): equal bit for bit to the GEMV's [1, 2n] output through fused_ops.silu_and_mul."""
    from nanovllm.kernels.fused_ops import silu_and_mul

    if weights_kind == "fp8-blocks" and n % 128:
        pytest.skip("block scales need gate and up on 128-row boundaries")
    gen = torch.Generator().manual_seed(7 * n + k + len(weights_kind))
    w, scale, w32 = weights(2 * n, k, weights_kind == "fp8", gen)
    if weights_kind == "fp8-blocks":
        w, scale = _fp8_blocks(w32 * 3)
    x = (torch.randn(1, k, generator=gen) * 2).to(DTYPE).to(DEVICE)
    bias = None if weights_kind != "16-bit" else (torch.randn(2 * n, generator=gen) * 0.5).to(DTYPE).to(DEVICE)
    fused = dense_gemv(x, w, scale=scale, bias=bias, silu_mul=True, tile=tile)
    gate_up = dense_gemv(x, w, scale=scale, bias=bias, tile=tile)
    assert fused.shape == (1, n) and torch.equal(fused, silu_and_mul(gate_up))
    if weights_kind == "16-bit":  # (the plain GEMV's own accuracy: test_plain_equals_torch)
        close(gate_up, x.float().cpu() @ w32.t() + bias.float().cpu())


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("n, k, tile", SHAPES)
def test_norm_prologue_equals_the_separate_kernel(n, k, tile, residual):
    gen = torch.Generator().manual_seed(3 * n + k + residual)
    w, _, w32 = weights(n, k, False, gen)
    x = torch.randn(1, k, generator=gen).to(DTYPE)
    r = torch.randn(1, k, generator=gen).to(DTYPE) if residual else None
    nw = (torch.rand(k, generator=gen) + 0.5).to(DTYPE)
    s = x + r if residual else x
    normed = rms_normed(s, nw)
    got = dense_gemv(x.to(DEVICE), w, prologue=Prologue.RMS_NORM, residual=None if r is None else r.to(DEVICE),
                     norm_weight=nw.to(DEVICE), eps=EPS, tile=tile)
    out, new_residual = got if residual else (got, None)
    if residual:
        assert torch.equal(new_residual.cpu(), s)  # one rounded add: exact
    assert torch.equal(out, dense_gemv(normed.to(DEVICE), w, tile=tile))
    close(out, normed.float() @ w32.t())


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("n, k, tile", SHAPES)
def test_residual_epilogue_and_a_norm_from_its_parts(n, k, tile, fp8):
    """A GEMV adding the residual to its output (o_proj / down_proj's place), writing that stream
    s, s times the next norm's weight and each program's sum of s^2; the next GEMV taking that
    product and those sums (NORM_PARTS). s equals the plain GEMV's output + r bit for bit (one
    rounded add, as torch) and the product s * weight rounded once; the parts add up to the sum of
    squares (fp32 order: 1e-5). The normed GEMV is within one ulp of the same arithmetic in fp32
    (the product's row @ W^T times rsqrt of the parts' total) and, against the unfused norm
    (s * rsqrt rounded, then times the weight, rounded), within one_rounding_apart + two ulps."""
    gen = torch.Generator().manual_seed(11 * n + k + fp8)
    w, scale, _ = weights(n, k, fp8, gen)
    x = torch.randn(1, k, generator=gen).to(DTYPE).to(DEVICE)
    r = torch.randn(1, n, generator=gen).to(DTYPE).to(DEVICE)
    nw = (torch.rand(n, generator=gen) + 0.5).to(DTYPE)
    s, parts, scaled = dense_gemv(x, w, scale=scale, add_residual=r, tile=tile, next_norm_weight=nw.to(DEVICE))
    assert torch.equal(s, (dense_gemv(x, w, scale=scale, tile=tile).float() + r.float()).to(DTYPE))
    assert torch.equal(scaled.cpu(), (s.cpu().float() * nw.float()).to(DTYPE))
    assert dense_gemv(x, w, scale=scale, add_residual=r, tile=tile)[2] is None
    total = (s.float() ** 2).sum()
    assert parts.dtype == torch.float32 and abs(parts.sum() - total) <= 1e-5 * total
    w2, scale2, w2_32 = weights(24, n, fp8, gen)
    out = dense_gemv(scaled, w2, scale=scale2, prologue=Prologue.NORM_PARTS, norm_parts=parts, eps=EPS)
    inv = torch.rsqrt(parts.sum().cpu() / n + EPS)
    close(out, (scaled.cpu().float() @ w2_32.t()) * inv)
    unfused = ((s.cpu().float() * inv).to(DTYPE) * nw).float() @ w2_32.t()  # fused_ops' two roundings
    assert ((out.cpu().float() - unfused).abs() <= one_rounding_apart(s.cpu().float() * inv * nw, w2_32)
            + 2 * ulp(unfused, DTYPE)).all()
    # gate_up's place: the norm from the parts with SiLU * up from the epilogue, bit for bit the
    # same GEMV's [1, 2I] output through fused_ops.silu_and_mul.
    from nanovllm.kernels.fused_ops import silu_and_mul

    w3, scale3, _ = weights(2 * 12, n, fp8, gen)
    folds = dict(scale=scale3, prologue=Prologue.NORM_PARTS, norm_parts=parts, tile=Tile(4, 32, 4))
    gated = dense_gemv(scaled, w3, silu_mul=True, **folds)
    assert gated.shape == (1, 12) and torch.equal(gated, silu_and_mul(dense_gemv(scaled, w3, **folds)))


@pytest.mark.skipif(CUDA, reason="the interpreter's per-row sums do not depend on the tile; the GPU's may")
@pytest.mark.parametrize("method", [None, "fp8-tensor"])
def test_gate_up_layer_writes_silu_mul_from_its_gemv(monkeypatch, method):
    """LinearBase.silu_mul's one-row dispatch (on CUDA only: one_row is widened to CPU rows here
    and the GEMV runs in the interpreter): the 16-bit weight and FP8's per-tensor method give
    SiLU * up of the layer's own one-row product, bit for bit, from one launch with silu_mul."""
    import nanovllm.features.quantization.fp8 as fp8
    import nanovllm.kernels.dense_gemv as dense
    import nanovllm.model.layers.linear as linear
    from nanovllm.kernels.fused_ops import silu_and_mul

    rows = lambda x: x.dim() == 2 and x.shape[0] == 1 and x.dtype == DTYPE  # noqa: E731
    monkeypatch.setattr(linear, "one_row", rows)
    monkeypatch.setattr(fp8, "one_row", rows)
    launches = []
    real = dense.dense_gemv
    monkeypatch.setattr(dense, "dense_gemv", lambda *a, **kw: launches.append(kw.get("silu_mul")) or real(*a, **kw))
    gen = torch.Generator().manual_seed(5)
    layer = linear.MergedColumnParallelLinear(96, [40, 40], bias=method is None)
    layer.weight.data = (torch.randn(80, 96, generator=gen) * 0.2).to(DTYPE)
    if layer.bias is not None:
        layer.bias.data = torch.randn(80, generator=gen).to(DTYPE)
    if method == "fp8-tensor":
        layer.quant = fp8.TensorFp8Linear()
        layer.quant.after_loading(layer)
    x = torch.randn(1, 96, generator=gen).to(DTYPE)
    fused = layer.silu_mul(x)
    assert launches == [True] and fused.shape == (1, 40)
    assert torch.equal(fused, silu_and_mul(layer(x)))


@pytest.mark.skipif(CUDA, reason="the interpreter's per-row sums do not depend on the tile; the GPU's may")
def test_the_mlp_takes_silu_mul_from_gate_ups_epilogue(monkeypatch):
    """decoder.DenseMLP at one row (one_row widened to CPU rows, the interpreter): gate_up's GEMV
    makes silu(gate) * up in its epilogue, then down's plain GEMV; bit for bit the unfused
    down(silu_and_mul(gate_up(x)))."""
    import nanovllm.kernels.dense_gemv as dense
    import nanovllm.model.layers.linear as linear
    from nanovllm.kernels.fused_ops import silu_and_mul
    from nanovllm.model.decoder import DenseMLP

    monkeypatch.setattr(linear, "one_row", lambda x: x.dim() == 2 and x.shape[0] == 1 and x.dtype == DTYPE)
    launches = []
    real = dense.dense_gemv
    monkeypatch.setattr(dense, "dense_gemv", lambda *a, **kw: launches.append(
        (kw.get("prologue", Prologue.PLAIN), kw.get("silu_mul", False))) or real(*a, **kw))
    gen = torch.Generator().manual_seed(9)
    mlp = DenseMLP(32, 40, bias=False)
    for p in mlp.parameters():
        p.data = (torch.randn(p.shape, generator=gen) * 0.3).to(DTYPE)
    x = torch.randn(1, 32, generator=gen).to(DTYPE)
    out = mlp(x)
    assert launches == [(Prologue.PLAIN, True), (Prologue.PLAIN, False)] and out.shape == (1, 32)
    launches.clear()
    assert torch.equal(out, mlp.down_proj(silu_and_mul(mlp.gate_up_proj(x))))


@pytest.mark.parametrize("call, match", [
    (lambda: dense_gemv(torch.zeros(2, 8, dtype=DTYPE), torch.zeros(4, 8, dtype=DTYPE)), "one row"),
    (lambda: dense_gemv(torch.zeros(1, 8, dtype=DTYPE), torch.zeros(4, 6, dtype=DTYPE)), r"\[N, 8\]"),
    (lambda: dense_gemv(torch.zeros(1, 8, dtype=DTYPE), torch.zeros(4, 8, dtype=FP8)), "scale"),
    (lambda: dense_gemv(torch.zeros(1, 8), torch.zeros(4, 8)), "bf16 / fp16"),
    (lambda: dense_gemv(torch.zeros(1, 8, dtype=DTYPE), torch.zeros(4, 8, dtype=FP8), scale=torch.ones(2, 1)),
     r"\[1, 1\]"),
    (lambda: dense_gemv(torch.zeros(1, 8, dtype=DTYPE), torch.zeros(4, 8, dtype=DTYPE),
                        prologue=Prologue.RMS_NORM), "norm_weight"),
    (lambda: dense_gemv(torch.zeros(1, 8, dtype=DTYPE), torch.zeros(5, 8, dtype=DTYPE), silu_mul=True), "gate and up"),
    (lambda: dense_gemv(torch.zeros(1, 8, dtype=DTYPE), torch.zeros(4, 8, dtype=DTYPE), silu_mul=True,
                        prologue=Prologue.RMS_NORM, norm_weight=torch.ones(8, dtype=DTYPE)), "no RMS_NORM"),
    (lambda: dense_gemv(torch.zeros(1, 8, dtype=DTYPE), torch.zeros(4, 8, dtype=DTYPE), prologue=Prologue.NORM_PARTS),
     "norm_parts"),
    (lambda: dense_gemv(torch.zeros(1, 8, dtype=DTYPE), torch.zeros(4, 8, dtype=DTYPE), prologue=Prologue.NORM_PARTS,
                        norm_parts=torch.ones(1), norm_weight=torch.ones(8, dtype=DTYPE)), "only it"),
    (lambda: dense_gemv(torch.zeros(1, 8, dtype=DTYPE), torch.zeros(4, 8, dtype=DTYPE),
                        next_norm_weight=torch.ones(4, dtype=DTYPE)), "comes with add_residual"),
    (lambda: dense_gemv(torch.zeros(1, 8, dtype=DTYPE), torch.zeros(4, 8, dtype=DTYPE),
                        add_residual=torch.zeros(1, 5, dtype=DTYPE)), r"\[1, 4\]"),
    (lambda: dense_gemv(torch.zeros(1, 8, dtype=DTYPE), torch.zeros(4, 8, dtype=FP8), scale=torch.ones(1, 1),
                        silu_mul=True), "block boundaries"),
])
def test_bad_operands_are_refused_before_launch(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.gpu
@pytest.mark.parametrize("quantization, rel_tol", [(None, 0.02), ("fp8", 0.1)])
def test_batch1_decode_matches_transformers_on_gpu(tmp_path, quantization, rel_tol):
    """One request alone, so every decode step runs the GEMVs (through the CUDA graph of one row;
    FP8: the codes widened in the GEMV, no activation quantization): greedy tokens agree with
    transformers in bf16 until a near-tie (FP8 weights: a wider one)."""
    import tiny_model as tm
    from test_gpu import check_greedy_close, prompts_of

    from nanovllm import LLM, SamplingParams

    path = tm.make_tiny_qwen3(tmp_path / "m", hidden_size=256, num_layers=3, num_heads=8, num_kv_heads=2,
                              head_dim=64, intermediate_size=512, dtype=torch.bfloat16)
    hf = tm.load_hf_model(path, dtype=torch.bfloat16, device="cuda")
    llm = LLM(path, max_model_len=512, quantization=quantization)
    for prompt in prompts_of([1, 40], seed=3):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        check_greedy_close(hf, prompt, out[0]["token_ids"], tm.hf_greedy(hf, prompt, 24), rel_tol=rel_tol)
    llm.shutdown()
