"""The model families behind the registry (Qwen2/2.5, Llama 3.x, Qwen3-MoE) against transformers.

Tiny random fp32 checkpoints (tests/tiny_model.py MODEL_CONFIGS) cover GQA and MQA, tied and
untied embeddings, Qwen2's q/k/v biases, Llama's attention_bias + mlp_bias and llama3 rope
scaling, MoE with and without norm_topk_prob, decoder_sparse_step 2 and a dense mlp_only_layers
layer. Checked on CPU:

1. greedy tokens equal transformers', also through prefix hits, chunked prefill and preemption;
2. teacher-forced logits (score(), and the rows of a chunked generate) equal transformers' within
   1e-4 (see assert_logits_close);
3. config errors: sliding window, rope types, activations, TP sizes;
4. the MoE pieces (router, experts, expert weight loading under TP, both checkpoint layouts) and
   the llama3 rope frequencies against transformers' own function.

Tensor parallelism (TP=2 on gloo) is in tests/test_parallel.py.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import tiny_model as tm  # noqa: E402
from helpers import (  # noqa: E402
    BLOCK,
    assert_idle,
    copy_checkpoint,
    edit_json,
    greedy,
    hf_logits,
    hf_reference,
    make_llm,
    rand_ids,
    reference_moe,
    rewrite_safetensors,
    tiny_checkpoint,
)

from nanovllm.config import Config
import nanovllm.wiring as wiring  # noqa: E402

NAMES = list(tm.MODEL_CONFIGS)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def assert_matches_hf(path, prompts, outputs, max_tokens):
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        ref = hf_reference(path, prompt, max_tokens)
        assert out["token_ids"] == ref, f"prompt {i} ({len(prompt)} tokens): engine {out['token_ids']} != hf {ref}"


def assert_logits_close(ours, ref):
    # fp32 on both sides; only summation orders differ (GEMM blocking, the paged attention's
    # softmax, the MoE's fp32 accumulation): ~1e-6 relative per op over a handful of layers at
    # logits of magnitude <= ~20 stays far below 1e-4, while a dropped or doubled bias, a wrong
    # rope frequency or a mis-routed expert moves logits by 1e-2 or more.
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


# ============================================================================================
# 1. Greedy tokens equal transformers'
# ============================================================================================


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers(tmp_path_factory, name):
    path = tiny_checkpoint(tmp_path_factory, name)
    vocab = Config.from_kwargs(path).resolve(wiring).hf_config.vocab_size
    prompts = [rand_ids(1, 1), rand_ids(BLOCK, 2), rand_ids(3 * BLOCK + 1, 3), [vocab - 1, 0, vocab - 2]]
    llm = make_llm(path)
    assert type(llm.model_runner.model).__name__ == llm.config.hf_config.architectures[0]  # the registry's pick
    outputs = llm.generate(prompts, greedy(16), use_tqdm=False)
    assert_matches_hf(path, prompts, outputs, 16)
    assert_idle(llm)


@pytest.mark.parametrize("name", NAMES)
def test_prefix_hits_chunked_prefill_and_preemption(tmp_path_factory, name):
    path = tiny_checkpoint(tmp_path_factory, name)
    common = rand_ids(2 * BLOCK, 70)
    prompts = [common + rand_ids(5, 71), common + rand_ids(9, 72), rand_ids(30, 73), rand_ids(20, 74)]
    # 8 blocks of 16 tokens for 4 requests that need 3-4 blocks each by the end: preemption;
    # 16 tokens a step for 37-41-token prompts: chunked prefill; the shared 2-block prefix and
    # the second round: prefix hits.
    llm = make_llm(path, num_kvcache_blocks=8, max_num_batched_tokens=16)
    for _ in range(2):
        outputs = llm.generate(prompts, greedy(24), use_tqdm=False)
        assert_matches_hf(path, prompts, outputs, 24)
    assert llm.scheduler.num_preemptions > 0
    assert llm.block_manager.num_prefix_hit_tokens >= 2 * BLOCK
    assert_idle(llm)


# ============================================================================================
# 2. Teacher-forced logits equal transformers'
# ============================================================================================


@pytest.mark.parametrize("name", NAMES)
def test_teacher_forced_logits_match_transformers(tmp_path_factory, name):
    path = tiny_checkpoint(tmp_path_factory, name)
    llm = make_llm(path, enable_prefix_caching=False, max_num_batched_tokens=7)
    seq = rand_ids(70, 80)
    assert_logits_close(llm.model_runner.score(seq), hf_logits(path, seq))
    # The rows a generate computes: 7-token prefill chunks attending to the cached ones, then decode.
    model, rows = llm.model_runner.model, []
    handle = model.register_forward_hook(lambda mod, args, out: rows.append(out.detach().clone()))
    try:
        out = llm.generate([seq[:40]], greedy(8), use_tqdm=False)[0]
    finally:
        handle.remove()
    with torch.inference_mode():
        ours = model.compute_logits(torch.cat(rows)).float()
    assert_logits_close(ours, hf_logits(path, seq[:40] + out["token_ids"][:-1]))


def test_llama3_rope_scaling_is_applied(tmp_path_factory):
    """The same weights without the scaling give other logits (so the test above sees it)."""
    path = tiny_checkpoint(tmp_path_factory, "llama_bias_rope3")
    plain = tiny_checkpoint(tmp_path_factory, "llama_bias_rope3", rope_scaling=None)
    seq = rand_ids(30, 81)
    a = make_llm(path).model_runner.score(seq)
    b = make_llm(plain).model_runner.score(seq)
    assert (a - b).abs().max() > 1e-2


# ============================================================================================
# 3. Config errors
# ============================================================================================


def _edited(tmp_path, name, tmp_path_factory, fn):
    folder = copy_checkpoint(tiny_checkpoint(tmp_path_factory, name), tmp_path / "ckpt")
    edit_json(os.path.join(folder, "config.json"), fn)
    return folder


@pytest.mark.parametrize("name,edit,pattern", [
    ("qwen2_mqa", lambda c: c.update(use_sliding_window=True, sliding_window=64, max_window_layers=0),
     "sliding-window attention is not supported"),
    # use_sliding_window alone (even if max_window_layers keeps every layer full) is refused.
    ("qwen2_mqa", lambda c: c.update(use_sliding_window=True), "sliding-window"),
    ("llama_mqa_tied", lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                       "original_max_position_embeddings": 64},
                                          rope_parameters=None), "rope_type 'yarn'.*supported: default, llama3"),
    ("llama_mqa_tied", lambda c: c.update(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, rope_parameters=None),
     "rope_type 'dynamic'"),
    ("llama_mqa_tied", lambda c: c.update(hidden_act="gelu"), "hidden_act 'gelu'"),
    ("moe_norm_topk", lambda c: c.update(num_experts_per_tok=9), "num_experts_per_tok=9"),
    ("moe_norm_topk", lambda c: c.update(decoder_sparse_step=0), "decoder_sparse_step"),
])
def test_unsupported_config_options_raise(tmp_path, tmp_path_factory, name, edit, pattern):
    folder = _edited(tmp_path, name, tmp_path_factory, edit)
    with pytest.raises(ValueError, match=pattern):
        Config.from_kwargs(folder).resolve(wiring)


@pytest.mark.parametrize("name,tp,pattern", [
    ("qwen2_mqa", 2, r"tensor_parallel_size=2 must divide .*key/value heads \(1\)"),
    ("moe_sparse_step", 2, r"key/value heads \(1\)"),
    ("moe_norm_topk", 3, r"tensor_parallel_size=3 must divide .*moe_intermediate_size \(32\)"),
])
def test_tensor_parallel_sizes_are_checked(tmp_path_factory, name, tp, pattern):
    with pytest.raises(ValueError, match=pattern):
        Config.from_kwargs(tiny_checkpoint(tmp_path_factory, name), tensor_parallel_size=tp).resolve(wiring)


def test_moe_layer_choice_follows_transformers(tmp_path_factory):
    from nanovllm.features.moe import SparseMoeBlock
    from nanovllm.model.decoder import DenseMLP

    for name, expected in (("moe_norm_topk", [True, False, True]), ("moe_sparse_step", [False, True, False])):
        path = tiny_checkpoint(tmp_path_factory, name)
        ours = [isinstance(layer.mlp, SparseMoeBlock) for layer in make_llm(path).model_runner.model.model.layers]
        theirs = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in tm.load_hf_model(path).model.layers]
        assert ours == theirs == expected
        dense = [layer.mlp for layer in make_llm(path).model_runner.model.model.layers if not isinstance(
            layer.mlp, SparseMoeBlock)]
        # The dense layers are of intermediate_size (128), the experts of moe_intermediate_size (32).
        assert dense and all(isinstance(m, DenseMLP) and m.gate_up_proj.weight.shape == (256, 64) for m in dense)


# ============================================================================================
# 4. Pieces: llama3 frequencies, router, experts, expert weights under TP, checkpoint layouts
# ============================================================================================


def test_llama3_inv_freq_equals_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from nanovllm.model.layers.rotary_embedding import rope_inv_freq
    from nanovllm.model.rope_scaling import Llama3RopeScaling

    for head_dim, theta, scaling in ((128, 500000.0, (8.0, 1.0, 4.0, 8192)), (64, 500000.0, (32.0, 1.0, 4.0, 8192)),
                                     (16, 10000.0, (4.0, 1.0, 4.0, 64))):
        cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                          rope_parameters={"rope_type": "llama3", "rope_theta": theta, "factor": scaling[0],
                                           "low_freq_factor": scaling[1], "high_freq_factor": scaling[2],
                                           "original_max_position_embeddings": scaling[3]})
        ref, attention_scaling = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        ours = rope_inv_freq(head_dim, theta, Llama3RopeScaling(*scaling))
        assert attention_scaling == 1.0
        assert torch.equal(ours, ref.float())
        plain = rope_inv_freq(head_dim, theta)
        # All three branches are taken: kept, divided by the factor, blended in between.
        kept = ours == plain
        slowed = torch.isclose(ours, plain / scaling[0], rtol=1e-6, atol=0)
        assert kept.any() and slowed.any() and (~kept & ~slowed).any()


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_and_experts_match_a_per_token_reference(fresh_seed, renormalize):
    from nanovllm.features.moe import moe_torch, route_topk

    T, H, I, E, k = 13, 24, 10, 6, 2
    logits = torch.randn(T, E)
    weights, ids = route_topk(logits, k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    probs = torch.softmax(logits.double(), dim=-1)
    for t in range(T):
        top = sorted(range(E), key=lambda e: -probs[t, e])[:k]
        assert ids[t].tolist() == top
        expected = probs[t, top] / (probs[t, top].sum() if renormalize else 1.0)
        torch.testing.assert_close(weights[t].double(), expected, rtol=1e-6, atol=0)
    # Experts from 0..E-2 only, so the last one gets no token (the sparse path skips it).
    ids = torch.stack([torch.randperm(E - 1)[:k] for _ in range(T)]).int()
    hidden, w13, w2 = torch.randn(T, H), torch.randn(E, 2 * I, H) / H ** 0.5, torch.randn(E, H, I) / I ** 0.5
    ref = reference_moe(hidden, w13, w2, weights, ids)
    # fp32 dot products over H=24 / I=10 and a k=2 sum: error ~ 1e-6 relative to values ~1.
    sparse = moe_torch(hidden, w13, w2, weights, ids)
    dense = moe_torch(hidden, w13, w2, weights, ids, dense=True)
    torch.testing.assert_close(sparse.double(), ref, rtol=1e-5, atol=1e-5)
    # Adding zeros for the experts a token skipped leaves its fp32 sum unchanged.
    torch.testing.assert_close(dense, sparse, rtol=1e-6, atol=1e-6)
    # fp16 experts, fp32 accumulation: within fp16 rounding of the products (2^-10 relative).
    half = moe_torch(hidden.half(), w13.half(), w2.half(), weights, ids)
    torch.testing.assert_close(half.double(), ref, rtol=1e-2, atol=1e-2)


def test_moe_functions_reject_bad_arguments():
    from nanovllm.features.moe import moe_torch, route_topk

    with pytest.raises(ValueError, match="top_k=5"):
        route_topk(torch.randn(3, 4), 5, True)
    h, w13, w2 = torch.randn(3, 8), torch.randn(4, 6, 8), torch.randn(4, 8, 3)
    w, ids = route_topk(torch.randn(3, 4), 2, True)
    with pytest.raises(ValueError, match="inconsistent MoE shapes"):
        moe_torch(h, w13[:, :5], w2, w, ids)
    with pytest.raises(ValueError, match="topk_ids must be in"):
        moe_torch(h, w13, w2, w, ids + 4)
    with pytest.raises(ValueError, match="topk_weights"):
        moe_torch(h, w13, w2, w[:2], ids)


def test_expert_weights_split_across_ranks(fresh_seed):
    """Per-expert and fused tensors give each rank its slice of I; both ranks together hold
    the whole tensors; bad shapes and expert ids name the tensor."""
    from nanovllm.features.moe import MoeExperts
    from nanovllm.parallel.group import TPGroup, use_tp_group

    E, H, I = 3, 8, 6
    gate, up, down = torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I)
    shards = []
    for rank in range(2):
        with use_tp_group(TPGroup(rank=rank, size=2)):
            per_expert, fused = MoeExperts(E, H, I), MoeExperts(E, H, I)
        for e in range(E):
            per_expert.weight_loader(per_expert.w13, gate[e], f"x.{e}.gate_proj.weight", (e, 0))
            per_expert.weight_loader(per_expert.w13, up[e], f"x.{e}.up_proj.weight", (e, 1))
            per_expert.weight_loader(per_expert.w2, down[e], f"x.{e}.down_proj.weight", (e, 0))
        fused.weight_loader(fused.w13, torch.cat([gate, up], dim=1), "x.gate_up_proj", "fused")
        fused.weight_loader(fused.w2, down, "x.down_proj", "fused")
        assert torch.equal(per_expert.w13, fused.w13) and torch.equal(per_expert.w2, fused.w2)
        shards.append(per_expert)
        with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.1\.up_proj\.weight.*shape"):
            per_expert.weight_loader(per_expert.w13, up[1, :-1], "model.layers.0.mlp.experts.1.up_proj.weight", (1, 1))
        with pytest.raises(ValueError, match=r"experts\.3\.down_proj.*expert 3 but the model has 3"):
            per_expert.weight_loader(per_expert.w2, down[0], "m.experts.3.down_proj.weight", (3, 0))
        with pytest.raises(ValueError, match=r"x\.gate_up_proj.*shape"):
            fused.weight_loader(fused.w13, torch.cat([gate, up], dim=1)[:, 1:], "x.gate_up_proj", "fused")
    half = I // 2
    for r, s in enumerate(shards):
        assert s.w13.shape == (E, 2 * half, H) and s.w2.shape == (E, H, half)
        assert torch.equal(s.w13[:, :half], gate[:, r * half:(r + 1) * half])
        assert torch.equal(s.w13[:, half:], up[:, r * half:(r + 1) * half])
        assert torch.equal(s.w2, down[:, :, r * half:(r + 1) * half])
    # The ranks' partial sums add up to the whole layer's output.
    from nanovllm.features.moe import moe_torch, route_topk

    x = torch.randn(5, H)
    w, ids = route_topk(torch.randn(5, E), 2, True)
    whole = moe_torch(x, torch.cat([gate, up], dim=1), down, w, ids)
    torch.testing.assert_close(sum(moe_torch(x, s.w13, s.w2, w, ids) for s in shards), whole, rtol=1e-5, atol=1e-5)


def _params(path):
    from nanovllm.model.registry import model_class
    from nanovllm.model.loader import load_model

    config = Config.from_kwargs(path).resolve(wiring)
    hf = config.hf_config
    model = model_class(hf)(hf, sparse_mlp=config.sparse_mlp)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    load_model(model, path)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_fused_expert_checkpoints_load_like_per_expert_ones(tmp_path_factory, tmp_path):
    import json

    from safetensors import safe_open

    path = tiny_checkpoint(tmp_path_factory, "moe_norm_topk")
    # The test checkpoints are in the Hub's layout: per-expert tensors, "num_experts" in config.json.
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.7.down_proj.weight" in f.keys()
        assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in f.keys())
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["num_experts"] == 8
    fused = copy_checkpoint(path, tmp_path / "fused")
    tm.fuse_expert_tensors(fused)

    with safe_open(os.path.join(fused, "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
        assert not any(".experts.0." in k for k in f.keys())
    a, b = _params(path), _params(fused)
    assert a.keys() == b.keys()
    for name in a:
        assert not a[name].isnan().any(), f"{name} not loaded"
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("case", ["missing", "wrong_shape", "extra_expert"])
def test_bad_expert_tensors_are_named(tmp_path_factory, tmp_path, case):
    folder = copy_checkpoint(tiny_checkpoint(tmp_path_factory, "moe_norm_topk"), tmp_path / "ckpt")
    name = "model.layers.2.mlp.experts.5.up_proj.weight"

    def edit(t):
        if case == "missing":
            del t[name]
        elif case == "wrong_shape":
            t[name] = t[name][:, :-1]
        else:
            t["model.layers.2.mlp.experts.8.up_proj.weight"] = t[name].clone()

    rewrite_safetensors(folder, edit)
    pattern = {"missing": "missing tensor.*" + name.replace(".", r"\."), "wrong_shape": name.replace(".", r"\.") + ".*shape",
               "extra_expert": r"experts\.8\.up_proj\.weight.*expert 8 but the model has 8"}[case]
    with pytest.raises(ValueError, match=pattern):
        make_llm(folder)


def test_dispatch_uses_torch_without_the_kernel_on_cpu(monkeypatch):
    """fused_experts is the one switch: on CPU always plain torch, whatever is importable."""
    from nanovllm.features import moe

    calls = []
    monkeypatch.setattr(moe, "_fused_moe_kernel", lambda: calls.append(1) or (lambda *a: 1 / 0))
    x, w13, w2 = torch.randn(4, 8), torch.randn(3, 6, 8), torch.randn(3, 8, 3)
    w, ids = moe.route_topk(torch.randn(4, 3), 2, False)
    assert torch.equal(moe.fused_experts(x, w13, w2, w, ids), moe.moe_torch(x, w13, w2, w, ids))
    assert not calls
