"""INT4 weight-only checkpoints (features/quantization/int4*.py, kernels/w4a16.py) on CPU, float32.

The checkpoints are made in the test (int4_checkpoints.py: random tiny Qwen3 weights quantized
and packed from each format's description). The reference is transformers on the *dequantized*
weights: greedy tokens must be equal. The unpacking is also checked layer by layer against the
dequantized weights, and the Triton kernel (interpreter) against the same arithmetic in torch.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import tiny_model as tm  # noqa: E402
from helpers import greedy, make_llm, rand_ids  # noqa: E402
from int4_checkpoints import quantized_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tm.make_tiny_qwen3(tmp_path_factory.mktemp("int4_base"), num_layers=2, seed=3)


# (act orders in groups of 32: every projection's input features reordered over 2-4 groups)
CASES = [("gptq", 32, True, False), ("gptq_v2", 32, False, True), ("gptq", -1, True, False),
         ("gptq", 64, False, True), ("awq", 32, False, False), ("compressed-tensors", 32, True, False),
         ("compressed-tensors", -1, False, False), ("compressed-tensors", 32, True, True)]


@pytest.mark.parametrize("fmt, group, sym, act_order", CASES)
def test_greedy_equals_transformers_on_the_dequantized_weights(base, tmp_path, fmt, group, sym, act_order):
    int4, dequantized = quantized_checkpoint(base, tmp_path, fmt, group, sym, act_order)
    llm = make_llm(int4)
    prompts = [rand_ids(9, 1), rand_ids(23, 2)]
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(12), use_tqdm=False)]
    hf = tm.load_hf_model(dequantized)
    assert got == [tm.hf_greedy(hf, p, 12) for p in prompts]
    # Layer by layer: the kernels' layout dequantizes to the checkpoint's values exactly.
    from nanovllm.features.quantization.int4_formats import dequantize

    layer = llm.model_runner.model.model.layers[0].mlp.down_proj
    w = dequantize(layer.int4)
    if layer.int4.perm is not None:
        w = w[torch.argsort(layer.int4.perm)]
    want = hf.model.layers[0].mlp.down_proj.weight.detach().t()
    assert torch.allclose(w, want, atol=1e-6, rtol=1e-5), (w - want).abs().max()


@pytest.mark.parametrize("m, group, k, config", [
    (1, 64, 1024, None), (3, 256, 512, "gemv"), (4, 32, 480, "gemv"),  # GEMV: a tile over 8 groups; K not in whole tiles
    (5, 32, 512, None), (70, 128, 256, None), (3, 32, 480, "mma"),  # tensor cores: split-K 4, 2; 15 K-tiles in 4 splits
    (20, 64, 512, "mma-split"), (37, 256, 512, "mma-split"),  # groups smaller / larger than the K-tile
    (8, 96, 576, None),  # a group that is no multiple of the K-tile (64): each word's own group
    (130, 64, 256, None), (40, 32, 256, "mma-256"),  # 128-row tiles (2 programs, masked rows); 256
    (520, 32, 256, None), (3, 32, 480, "dequant"),  # the weight dequantized, then a matmul
    (5, 64, 256, "dequant")])  # 96 columns in tiles of 64: the second tile half masked
@pytest.mark.parametrize("n", [96, 128])  # a last column tile half masked; whole tiles (no masks: EVEN_N)
def test_the_kernel_equals_its_torch_arithmetic(m, group, k, config, n):
    """kernels/w4a16.py under the Triton interpreter (fp32): the GEMV up to 4 rows (several
    groups per step, a masked last step), the unpacking tensor-core kernel (w4a16_mma.py: split-K
    with fp32 partials that a second kernel sums, masked rows and columns, groups smaller and
    larger than its K-tile, 16- to 256-row tiles; rows past M masked; whole column tiles loaded
    without masks), and from DEQUANT_MIN_M rows the dequantizing kernel (into a NaN-poisoned
    workspace, masked columns) and a matmul. The same products summed in another order: within
    1e-4. The reference reads the words through int4_formats.dequantize, which the test below
    checks against the fragment order's description."""
    from nanovllm.features.quantization.int4_formats import Int4Weights, dequantize
    from nanovllm.kernels.w4a16 import Dequant, Gemv, Mma, w4a16_matmul

    config = {"gemv": Gemv(16, 32, 4), "mma": Mma(16, 64, 32, 4), "mma-split": Mma(16, 32, 128, 2),
              "mma-256": Mma(256, 64, 64, 2), "dequant": Dequant(4, 64), None: None}[config]

    g = torch.Generator().manual_seed(m)
    w = Int4Weights(torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=g).to(torch.int32),
                    torch.rand(k // group, n, generator=g) * 0.01, torch.randint(0, 16, (k // group, n), generator=g)
                    .float(), group, None)
    x = torch.randn(m, k, generator=g)
    workspace = torch.full((k * n + 5,), float("nan"))
    got = w4a16_matmul(x, w.qweight, w.scales, w.zeros, group, config=config, workspace=workspace)
    want = x @ dequantize(w)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def test_the_kernel_layout_holds_rows_in_fragment_order():
    """int4_formats.pack_kernel_order against its description, element by element: nibble
    j = 4c + 2a + b of word 4 * blk + t is K-row 32 * blk + 16a + 8b + 2t + c; unpack_kernel_order
    (what dequantize reads) inverts it, with and without a leading experts axis; a K that is not
    whole blocks keeps its last rows in plain order."""
    from nanovllm.features.quantization.int4_formats import pack_kernel_order, unpack_kernel_order

    g = torch.Generator().manual_seed(7)
    q = torch.randint(0, 16, (3, 96, 5), generator=g, dtype=torch.int32)
    words = pack_kernel_order(q)
    assert words.shape == (3, 12, 5) and words.dtype == torch.int32
    for blk in range(3):
        for t in range(4):
            for j in range(8):
                c, a, b = j // 4, (j // 2) % 2, j % 2
                nibble = (words[:, 4 * blk + t] >> (4 * j)) & 0xF
                assert torch.equal(nibble, q[:, 32 * blk + 16 * a + 8 * b + 2 * t + c])
    assert torch.equal(unpack_kernel_order(words), q)
    assert torch.equal(unpack_kernel_order(pack_kernel_order(q[0])), q[0])
    # One group per column allows a K of whole words only (48, 72: 16 and 8 rows past the last
    # block), which only the torch path multiplies: those rows stay in plain order, and load.
    for k in (48, 72):
        q = torch.randint(0, 16, (k, 4), generator=g, dtype=torch.int32)
        words = pack_kernel_order(q)
        tail = (words[k // 32 * 4:, None, :] >> (4 * torch.arange(8)[None, :, None])) & 0xF
        assert torch.equal(tail.reshape(-1, 4), q[k // 32 * 32:]) and torch.equal(unpack_kernel_order(words), q)


@pytest.mark.parametrize("k, n, group, strips", [
    (1024, 96, 128, (32, 2)),  # 4 steps (each prefetching the next); whole blocks and steps: EVEN, no masks
    (480, 64, 32, (16, 1)),  # groups of 32 (one strip); K not in whole steps: masked rows
    (768, 40, -1, (16, 1))])  # one group per column (group_size = K = 768); 2 of 3 column blocks whole
def test_the_batch1_gemv_equals_its_torch_arithmetic(k, n, group, strips):
    """kernels/w4a16_gemv.py under the Triton interpreter (the shift path of the inline PTX's
    unpacking; x bf16, read as int32 pairs, also from a view that starts mid-pair): fp32 sums of
    the same products in another order, then rounded to bf16 (the interpreter may round toward
    zero): within 2^-7 of the value + 1e-3."""
    from nanovllm.features.quantization.int4_formats import Int4Weights, dequantize
    from nanovllm.kernels.w4a16 import Strips, w4a16_matmul

    g = torch.Generator().manual_seed(k)
    groups = 1 if group < 0 else k // group
    w = Int4Weights(torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=g).to(torch.int32),
                    (torch.rand(groups, n, generator=g) * 0.01).to(torch.bfloat16),
                    torch.randint(0, 16, (groups, n), generator=g).to(torch.bfloat16), group if group > 0 else k, None)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    want = x.float() @ dequantize(w).float()
    odd = torch.cat([torch.zeros(1, 1, dtype=x.dtype), x], 1)[:, 1:]  # a view starting mid-pair
    for xs in (x, odd):
        got = w4a16_matmul(xs, w.qweight, w.scales, w.zeros, w.group_size, config=Strips(*strips)).float()
        assert torch.allclose(got, want, rtol=2**-7, atol=1e-3), (got - want).abs().max()
    with pytest.raises(ValueError, match="one bf16 row"):
        w4a16_matmul(x.float(), w.qweight, w.scales, w.zeros, w.group_size, config=Strips(*strips))


@pytest.mark.parametrize("k, half, group, strips", [(1024, 48, 128, (32, 2)), (480, 40, 32, (16, 1))])
def test_the_batch1_gemv_silu_epilogue_equals_the_separate_kernel(k, half, group, strips):
    """gate_up's batch-1 GEMV writing silu(gate) * up (a program's columns half gate, half the
    same columns of up): bit for bit the GEMV's [1, 2 * half] output through fused_ops.silu_and_mul
    (each column's sum is the same in both launches; the roundings are fused_ops.silu_mul_rounded)."""
    from nanovllm.features.quantization.int4_formats import Int4Weights
    from nanovllm.kernels.fused_ops import silu_and_mul
    from nanovllm.kernels.w4a16_gemv import Strips, gemv

    g = torch.Generator().manual_seed(k + half)
    n = 2 * half
    w = Int4Weights(torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=g).to(torch.int32),
                    (torch.rand(k // group, n, generator=g) * 0.02).to(torch.bfloat16),
                    torch.randint(0, 16, (k // group, n), generator=g).to(torch.bfloat16), group, None)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    cfg = Strips(*strips)
    fused = gemv(x, w.qweight, w.scales, w.zeros, group, cfg, silu_mul=True)
    gate_up = gemv(x, w.qweight, w.scales, w.zeros, group, cfg)
    assert fused.shape == (1, half) and torch.equal(fused, silu_and_mul(gate_up))
    with pytest.raises(ValueError, match="gate and up"):
        gemv(x, w.qweight[:, :36], w.scales[:, :36], w.zeros[:, :36], group, cfg, silu_mul=True)


def _random_int4(k: int, n: int, group: int, g: torch.Generator):
    from nanovllm.features.quantization.int4_formats import Int4Weights

    return Int4Weights(torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=g).to(torch.int32),
                       (torch.rand(k // group, n, generator=g) * 0.02).to(torch.bfloat16),
                       torch.randint(0, 16, (k // group, n), generator=g).to(torch.bfloat16), group, None)


def _within_ulp(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within one bf16 ulp (the interpreter truncates to bf16 where torch rounds to nearest)."""
    w = want.float()
    return bool(((got.float() - w).abs() <= torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(1e-30))) - 7)).all())


@pytest.mark.parametrize("k, n, strips", [(256, 64, (16, 1)), (1024, 96, (32, 2)), (256, 256, (16, 1))])
def test_the_batch1_gemv_norm_folds(k, n, strips):
    """The INT4 GEMV's folds of model/norm_chain.py, in the interpreter (n = 256: the GEMVs taking
    the folds' outputs run whole strips, EVEN, as in a real model; smaller n masked): add_residual writes
    s = out + r (each rounded), s * the next norm's weight and each program's sum of s^2; a GEMV
    taking that product with those sums (norm_parts) and a bias equals the same arithmetic in torch
    (the product's row @ the dequantized weight * rsqrt(mean + eps) + bias: within 2^-7 + 1e-3, as
    the plain GEMV), and gate_up's SiLU * up from it is bit for bit that GEMV's through silu_and_mul."""
    from nanovllm.features.quantization.int4_formats import dequantize
    from nanovllm.kernels.fused_ops import silu_and_mul
    from nanovllm.kernels.w4a16_gemv import Strips, gemv

    g, cfg, eps = torch.Generator().manual_seed(k + n), Strips(*strips), 1e-6
    w, w2, w3 = _random_int4(k, n, 128, g), _random_int4(n, 32, 32, g), _random_int4(n, 64, 32, g)
    x, r = torch.randn(1, k, generator=g).to(torch.bfloat16), torch.randn(1, n, generator=g).to(torch.bfloat16)
    nw, bias = (torch.rand(n, generator=g) + 0.5).to(torch.bfloat16), torch.randn(32, generator=g).to(torch.bfloat16)
    s, parts, scaled = gemv(x, w.qweight, w.scales, w.zeros, 128, cfg, add_residual=r, next_norm_weight=nw)
    assert _within_ulp(s, gemv(x, w.qweight, w.scales, w.zeros, 128, cfg).float() + r.float())
    assert _within_ulp(scaled, s.float() * nw.float())
    assert parts.dtype == torch.float32 and torch.allclose(parts.sum(), (s.float() ** 2).sum(), rtol=1e-5)
    out = gemv(scaled, w2.qweight, w2.scales, w2.zeros, 32, Strips(16, 1), bias=bias, norm_parts=parts, eps=eps)
    want = scaled.float() @ dequantize(w2).float() * torch.rsqrt(parts.sum() / n + eps) + bias.float()
    assert torch.allclose(out.float(), want, rtol=2**-7, atol=1e-3), (out.float() - want).abs().max()
    folds = dict(norm_parts=parts, eps=eps)
    gated = gemv(scaled, w3.qweight, w3.scales, w3.zeros, 32, Strips(16, 1), silu_mul=True, **folds)
    assert torch.equal(gated, silu_and_mul(gemv(scaled, w3.qweight, w3.scales, w3.zeros, 32, Strips(16, 1), **folds)))
    for bad, match in ((dict(add_residual=torch.zeros(1, n + 1, dtype=torch.bfloat16)), r"\[1, %d\]" % n),
                       (dict(next_norm_weight=nw), "comes with add_residual"),
                       (dict(bias=torch.zeros(n - 1, dtype=torch.bfloat16)), "bias"),
                       (dict(add_residual=r, norm_parts=parts), "no add_residual")):
        with pytest.raises(ValueError, match=match):
            gemv(x, w.qweight, w.scales, w.zeros, 128, cfg, **bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the CUDA-only dispatch on CPU rows, in the interpreter")
@pytest.mark.parametrize("act_order", [False, True])
def test_an_int4_gate_up_layer_writes_silu_mul_from_its_gemv(monkeypatch, act_order):
    """LinearBase.silu_mul -> Int4Linear.apply_silu_mul at one bf16 row (one_row widened to CPU
    rows; the strips GEMV in the interpreter), x permuted first under act-order: SiLU * up of the
    GEMV's own product on the same permuted x, bit for bit."""
    import nanovllm.features.quantization.int4 as int4
    import nanovllm.model.layers.linear as linear
    from nanovllm.features.quantization.int4_formats import Int4Weights
    from nanovllm.kernels.fused_ops import silu_and_mul
    from nanovllm.kernels.w4a16 import choose
    from nanovllm.kernels.w4a16_gemv import gemv

    rows = lambda x: x.dim() == 2 and x.shape[0] == 1 and x.dtype == torch.bfloat16  # noqa: E731
    monkeypatch.setattr(linear, "one_row", rows)
    monkeypatch.setattr(int4, "one_row", rows)
    g = torch.Generator().manual_seed(11 + act_order)
    k, n = 256, 64
    layer = linear.MergedColumnParallelLinear(k, [n // 2] * 2)
    perm = torch.randperm(k, generator=g) if act_order else None
    layer.int4 = w = Int4Weights(torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=g).to(torch.int32),
                                 (torch.rand(k // 128, n, generator=g) * 0.02).to(torch.bfloat16),
                                 torch.randint(0, 16, (k // 128, n), generator=g).to(torch.bfloat16), 128, perm)
    layer.quant = int4.Int4Linear(config=None)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    xp = x if perm is None else x.index_select(-1, perm)
    want = silu_and_mul(gemv(xp, w.qweight, w.scales, w.zeros, 128, choose(1, n, k)))
    assert torch.equal(layer.silu_mul(x), want)


@pytest.mark.gpu
def test_batch1_decode_matches_transformers_on_gpu(tmp_path):
    """One request alone, so every decode step runs the INT4 batch-1 GEMVs in the one-row CUDA
    graph, gate_up writing SiLU * up from its epilogue: greedy tokens agree with the exact model
    (transformers in float32 on the dequantized weights) until a tie within bf16's own logit error
    (test_gpu.check_greedy_near_exact). A fixed relative bound was tighter than that error here:
    transformers bf16 itself is up to ~0.3-0.4 off float32 on this model, and the engine keeps the
    fp16 scales as bf16 and skips rounding each dequantized weight, so it parts from transformers
    bf16 at ties of that size (scripts/int4_precision.py shows where)."""
    from test_gpu import check_greedy_near_exact, prompts_of

    from nanovllm import LLM, SamplingParams

    path = tm.make_tiny_qwen3(tmp_path / "m", hidden_size=256, num_layers=3, num_heads=8, num_kv_heads=2,
                              head_dim=64, intermediate_size=512, dtype=torch.bfloat16)
    int4, dense = quantized_checkpoint(path, tmp_path, "gptq", 128, True, False)
    exact = tm.load_hf_model(dense, dtype=torch.float32, device="cuda")
    hf16 = tm.load_hf_model(dense, dtype=torch.bfloat16, device="cuda")
    llm = LLM(int4, max_model_len=512)
    for prompt in prompts_of([1, 40], seed=3):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        check_greedy_near_exact(exact, hf16, prompt, out[0]["token_ids"])
    llm.shutdown()


@pytest.mark.parametrize("config", [(16, 64, 96), (16, 64, 256), (96, 64, 64), (512, 64, 64)])
def test_a_tensor_core_launch_that_does_not_fit_is_refused(config):
    """No mask along K: a K-tile that does not divide K would drop rows; tiles of rows of x other
    than 16 / 32 / 64 / 128 / 256 are refused (kernels/w4a16_mma.py)."""
    from nanovllm.kernels.w4a16 import Mma, w4a16_matmul

    k, n = 384, 64
    with pytest.raises(ValueError, match="does not fit"):
        w4a16_matmul(torch.randn(4, k), torch.zeros(k // 8, n, dtype=torch.int32), torch.ones(k // 128, n),
                     torch.zeros(k // 128, n), 128, config=Mma(*config))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group, config", [(64, (16, 64, 128, 2)), (128, (64, 64, 128)), (32, (32, 128, 128, 4, 8)),
                                           (128, (128, 64, 64, 1, 4, 4)), (64, (256, 64, 64, 1, 4, 4))])
def test_the_tensor_core_kernel_unpacks_exactly_on_gpu(dtype, group, config):
    """kernels/w4a16_mma.py's inline-PTX unpacking (CUDA only): x is the identity, so output row k
    is K-row k of the weight as the kernel unpacked it (1 x w is exact, and so is a sum of one
    product): equal bit for bit to (q - z) * s rounded once to 16 bits, in torch. Groups smaller
    than the K-tile (with split-K's fp32 sums) and not, 16- to 256-row tiles of x, 8 warps;
    fresh random words each run."""
    from nanovllm.features.quantization.int4_formats import unpack_kernel_order
    from nanovllm.kernels.w4a16 import Mma, w4a16_matmul

    k, n = 512, 192
    g = torch.Generator(device="cuda")
    seed = g.seed()
    q = torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=g, device="cuda", dtype=torch.int64).to(torch.int32)
    s = (torch.rand(k // group, n, generator=g, device="cuda") * 0.01 + 1e-4).to(dtype)
    z = torch.randint(0, 16, (k // group, n), generator=g, device="cuda").to(dtype)
    got = w4a16_matmul(torch.eye(k, device="cuda", dtype=dtype), q, s, z, group, config=Mma(*config))
    rows = torch.arange(k, device="cuda") // group
    want = ((unpack_kernel_order(q).float() - z.float()[rows]) * s.float()[rows]).to(dtype)
    assert torch.equal(got, want), (seed, (got.float() - want.float()).abs().max())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k, n", [(4096, 24576), (12288, 4096)])
def test_chosen_launches_stay_right_when_programs_share_sms(k, n):
    """choose's launches at Qwen3-8B's gate_up and down shapes, 2-256 rows: most launch more programs
    than the GPU has SMs, so several run on one SM at once, the case in which Triton 3.6's pipelined
    register-operand wgmma let 8-warp 128 x 128 tiles read weights already overwritten (BENCHMARKS.md).
    Against x @ the dequantized weight in fp32: the output is rounded to bf16 (2^-9 of a value) and
    summed in another order; 1e-2 of the largest output is 5x that, and the wrong tiles were off
    by up to 226 times the largest output. A second run gives the same bits (split K included)."""
    from nanovllm.features.quantization.int4_formats import Int4Weights, dequantize
    from nanovllm.kernels.w4a16 import w4a16_matmul

    g = torch.Generator(device="cuda")
    seed = g.seed()
    q = torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=g, device="cuda", dtype=torch.int64).to(torch.int32)
    s = (torch.rand(k // 128, n, generator=g, device="cuda") * 0.004 + 1e-4).to(torch.bfloat16)
    z = torch.randint(0, 16, (k // 128, n), generator=g, device="cuda").to(torch.bfloat16)
    w = dequantize(Int4Weights(q, s, z, 128, None))
    for m in (2, 16, 64, 136, 256):
        x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
        out = w4a16_matmul(x, q, s, z, 128)  # (a NaN fails the bound too)
        ref = x.float() @ w
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-2, (seed, m, err)
        assert torch.equal(w4a16_matmul(x, q, s, z, 128), out), (seed, m)  # split K too: the same bits each run


@pytest.mark.parametrize("qc, error, match", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, ValueError, "bits=8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 48}, ValueError, "group_size=48"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"}, ValueError, "marlin"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": False}, ValueError, "zero_point"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, ValueError, "gemv"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {}}, ValueError,
     "pack-quantized"),
])
def test_unsupported_settings_are_refused_before_loading(base, tmp_path, qc, error, match):
    import shutil

    folder = tmp_path / "q"
    shutil.copytree(base, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(error, match=match):
        make_llm(str(folder))


def test_packed_projections_with_different_act_orders_are_refused(base, tmp_path):
    """q / k / v (and gate / up) read one input, so GPTQ gives them one order; a checkpoint whose
    k_proj has another cannot share the packed layer's and is named."""
    from safetensors.torch import load_file, save_file

    int4, _ = quantized_checkpoint(base, tmp_path, "gptq_v2", 32, False, True)
    tensors = load_file(os.path.join(int4, "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, os.path.join(int4, "model.safetensors"))
    with pytest.raises(ValueError, match="activation order differs"):
        make_llm(int4)


def test_act_order_with_tensor_parallelism_is_refused(base, tmp_path):
    int4, _ = quantized_checkpoint(base, tmp_path, "gptq_v2", 32, False, True)
    with pytest.raises(ValueError, match="activation order"):
        make_llm(int4, tensor_parallel_size=2)


@pytest.mark.parametrize("fmt, group, sym", [("gptq_v2", 32, False), ("awq", 32, False), ("compressed-tensors", 32, True),
                                             ("gptq", -1, True)])
def test_tensor_parallelism_shards_whole_groups(base, tmp_path, fmt, group, sym):
    """TP = 2 (gloo on the CPU): each rank loads its share of the packed words, scales and zero
    points (column-parallel layers by output features, row-parallel ones by whole input groups;
    one group per channel stays whole), and greedy tokens equal one rank's."""
    int4, _ = quantized_checkpoint(base, tmp_path, fmt, group, sym, False)
    prompts = [rand_ids(9, 1), rand_ids(23, 2)]
    with make_llm(int4) as one:
        want = [list(o.outputs[0].token_ids) for o in one.generate(prompts, greedy(10), use_tqdm=False)]
    with make_llm(int4, tensor_parallel_size=2) as two:
        assert [list(o.outputs[0].token_ids) for o in two.generate(prompts, greedy(10), use_tqdm=False)] == want
