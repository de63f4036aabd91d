"""INT4 MoE experts (features/quantization/int4_moe.py, kernels/fused_moe_int4.py) on CPU, float32.

Tiny random Qwen3-MoE checkpoints quantized in the test (int4_checkpoints.py: every expert's
gate / up / down projection and the attention's linears) against transformers on the
dequantized weights: greedy tokens must be equal. The fused kernel runs under the Triton
interpreter against the same arithmetic in torch.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import tiny_model as tm  # noqa: E402
from helpers import greedy, make_llm, rand_ids  # noqa: E402
from int4_checkpoints import logit_errors_on_gpu, quantized_checkpoint  # noqa: E402

from nanovllm.features.quantization.int4_formats import Int4Weights, dequantize  # noqa: E402
from nanovllm.features.quantization.int4_moe import moe_int4_torch  # noqa: E402
from nanovllm.kernels.fused_moe_int4 import Int4MoeConfig, Int4Stack, fused_moe_int4  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory):
    # moe_intermediate_size 64: two groups of 32 in down_proj's input
    return tm.make_tiny_qwen3_moe(tmp_path_factory.mktemp("int4_moe_base"), num_layers=2, seed=5,
                                  moe_intermediate_size=64)


@pytest.mark.parametrize("fmt, group, sym, act_order", [
    ("gptq", 32, True, False), ("gptq_v2", 32, False, True), ("awq", 32, False, False),
    ("compressed-tensors", -1, False, False)])
def test_moe_greedy_equals_transformers_on_the_dequantized_weights(moe_base, tmp_path, fmt, group, sym, act_order):
    int4, dequantized = quantized_checkpoint(moe_base, tmp_path, fmt, group, sym, act_order)
    llm = make_llm(int4)
    prompts = [rand_ids(9, 1), rand_ids(23, 2)]
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(10), use_tqdm=False)]
    hf = tm.load_hf_model(dequantized)
    assert got == [tm.hf_greedy(hf, p, 10) for p in prompts]
    # The stacked kernels' layout dequantizes to the checkpoint's values, expert by expert.
    experts = llm.model_runner.model.model.layers[1].mlp.experts
    stack = experts.int4_w2
    w = dequantize(stack)[3]
    if stack.perm is not None:
        w = w[torch.argsort(stack.perm[3].long())]
    want = hf.model.layers[1].mlp.experts
    want = want[3].down_proj.weight if hasattr(want, "__getitem__") else want.down_proj[3]
    assert torch.allclose(w, want.detach().float().t(), atol=1e-6, rtol=1e-5)


def random_stack(gen, e, k, n, group, permuted):
    perm = torch.stack([torch.randperm(k, generator=gen) for _ in range(e)]).to(torch.int32) if permuted else None
    return Int4Stack(torch.randint(-2**31, 2**31 - 1, (e, k // 8, n), generator=gen).to(torch.int32),
                     torch.rand(e, k // group, n, generator=gen) * 0.05 + 0.01,
                     torch.randint(0, 16, (e, k // group, n), generator=gen).float(), group, perm)


@pytest.mark.parametrize("tokens, group, permuted, config", [
    (1, 32, False, None), (3, 64, True, None), (40, 32, True, Int4MoeConfig(32, 32, 4, 2)),
    (9, 64, False, Int4MoeConfig(16, 64, 4, 2))])
def test_the_fused_kernel_equals_its_torch_arithmetic(tokens, group, permuted, config):
    """Fresh random experts each run (seed in the message), with and without act-order perms: the
    kernel's per-slot sums in another order than torch's, both fp32: within 1e-4 relative."""
    gen = torch.Generator()
    seed = gen.seed()
    e, k, h, n = 6, 2, 64, 64
    w13, w2 = random_stack(gen, e, h, 2 * n, group, permuted), random_stack(gen, e, n, h, group, permuted)
    x = torch.randn(tokens, h, generator=gen)
    logits = torch.randn(tokens, e, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), k)
    want = moe_int4_torch(x, w13, w2, weights, ids.to(torch.int32))
    got = fused_moe_int4(x, w13, w2, weights, ids.to(torch.int32), config)
    scale = want.abs().max().item()
    assert torch.isfinite(got).all() and (got - want).abs().max().item() <= 1e-4 * scale, (seed, (got - want).abs().max())


def test_moe_torch_reference_is_the_dequantized_products():
    """moe_int4_torch against an expert-by-expert loop written here: w = (q - z) * s per group."""
    gen = torch.Generator().manual_seed(0)
    e, h, n = 4, 64, 32
    w13, w2 = random_stack(gen, e, h, 2 * n, 32, True), random_stack(gen, e, n, h, 32, False)
    x = torch.randn(5, h, generator=gen, dtype=torch.float64).float()
    ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 3]], dtype=torch.int32)
    weights = torch.rand(5, 2, generator=gen)
    want = torch.zeros(5, h)
    for t in range(5):
        for j in range(2):
            ex = int(ids[t, j])
            wg = dequantize(Int4Weights(w13.qweight[ex], w13.scales[ex], w13.zeros[ex], 32, None))
            gate_up = torch.empty_like(wg)
            gate_up[w13.perm[ex].long()] = wg  # row i of the stored weight is input feature perm[i]
            g, u = (x[t] @ gate_up).split(n)
            act = torch.nn.functional.silu(g) * u
            down = dequantize(Int4Weights(w2.qweight[ex], w2.scales[ex], w2.zeros[ex], 32, None))
            want[t] += weights[t, j] * (act @ down)
    got = moe_int4_torch(x, w13, w2, weights, ids)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()


def test_dummy_int4_moe_runs_and_bad_group_sizes_are_refused(tmp_path):
    # quantization="gptq" with dummy weights: groups of 128, so 128 hidden and intermediate features
    moe = tm.make_tiny_qwen3_moe(tmp_path / "moe", hidden_size=128, head_dim=32, intermediate_size=128,
                                 moe_intermediate_size=128)
    llm = make_llm(moe, quantization="gptq", load_format="dummy")
    out = llm.generate([rand_ids(7, 3)], greedy(4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.model_runner.model.model.layers[0].mlp.experts.int4_w13.qweight.shape == (8, 16, 256)
    with pytest.raises(ValueError, match="hidden_size = 64 is not whole groups of 128"):
        make_llm(tm.make_tiny_qwen3_moe(tmp_path / "moe64"), quantization="gptq", load_format="dummy")
    base = tm.make_tiny_qwen3_moe(tmp_path / "moe48", moe_intermediate_size=48)
    int4, _ = quantized_checkpoint(base, tmp_path, "gptq", -1, True, False)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        make_llm(int4)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, permuted", [(1, False), (16, True), (300, False)])
def test_the_fused_kernel_on_gpu(tokens, permuted):
    """Compiled for the GPU with bf16 activations (Qwen3-30B-A3B's expert shapes, 16 experts)
    against the fp32 arithmetic: bf16 inputs, intermediate and slot outputs give relative errors
    of a few 1e-3 on sums of 2048 products; the bound is 2e-2."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    e, k, h, n, group = 16, 8, 2048, 768, 128

    def stack(k_in, n_out):
        perm = torch.stack([torch.randperm(k_in, generator=gen, device="cuda") for _ in range(e)]).to(torch.int32)
        return Int4Stack(torch.randint(-2**31, 2**31 - 1, (e, k_in // 8, n_out), generator=gen, device="cuda")
                         .to(torch.int32), (torch.rand(e, k_in // group, n_out, generator=gen, device="cuda") * 0.004)
                         .to(torch.bfloat16), torch.randint(0, 16, (e, k_in // group, n_out), generator=gen,
                                                            device="cuda").to(torch.bfloat16), group,
                         perm if permuted else None)

    w13, w2 = stack(h, 2 * n), stack(n, h)
    x = torch.randn(tokens, h, generator=gen, device="cuda").to(torch.bfloat16)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, e, generator=gen, device="cuda"), -1), k)
    out = torch.full((tokens, h), float("nan"), device="cuda")
    out.copy_(fused_moe_int4(x, w13, w2, weights, ids.to(torch.int32)))
    fp32 = lambda s: Int4Stack(s.qweight, s.scales.float(), s.zeros.float(), group, s.perm)  # noqa: E731
    ref = moe_int4_torch(x.float(), fp32(w13), fp32(w2), weights, ids)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 2e-2


@pytest.mark.gpu
def test_int4_moe_checkpoint_on_gpu(tmp_path):
    """A tiny bf16 Qwen3-MoE quantized to GPTQ with an activation order, on the GPU with its CUDA
    graphs: the INT4 engine's teacher-forced logits against the fp32 engine on the dequantized
    checkpoint differ at most twice as much as the 16-bit engine's + 1e-3 (test_gpu.py's INT4
    bound and reasoning); greedy decoding runs."""
    base = tm.make_tiny_qwen3_moe(tmp_path / "base", hidden_size=128, head_dim=32, intermediate_size=128,
                                  moe_intermediate_size=128, dtype=torch.bfloat16, num_layers=2)
    int4, dense = quantized_checkpoint(base, tmp_path, "gptq_v2", 64, False, True)
    err = logit_errors_on_gpu(int4, dense, rand_ids(200, 4))
    assert err["int4"] < 2 * err["dense"] + 1e-3, err


def test_int4_experts_under_tensor_parallelism(moe_base, tmp_path):
    """TP = 2 (gloo): every expert's intermediate features split as the 16-bit experts' (gate /
    up by output features, down by whole input groups): greedy tokens equal one rank's."""
    int4, _ = quantized_checkpoint(moe_base, tmp_path, "gptq_v2", 32, False, False)
    prompts = [rand_ids(9, 1), rand_ids(23, 2)]
    with make_llm(int4) as one:
        want = [list(o.outputs[0].token_ids) for o in one.generate(prompts, greedy(10), use_tqdm=False)]
    with make_llm(int4, tensor_parallel_size=2) as two:
        assert [list(o.outputs[0].token_ids) for o in two.generate(prompts, greedy(10), use_tqdm=False)] == want
