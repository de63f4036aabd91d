"""EAGLE-3 heads (wip: features/speculative/eagle3_head.py): tiny random heads written in the
speculators format and in SGLang's (`midlayer`, no embedding: the target's is used) load, and
their forward equals a plain-torch one written from the formats' description (float32 on the
CPU, the same operations in another order: within 1e-5)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from nanovllm.features.speculative.eagle3_head import Eagle3Config, Eagle3Head, default_aux_layers, load_head
from nanovllm.model.attention import prefill_metadata, select_backend
from nanovllm.parallel.group import TPGroup, use_tp_group

H, HEADS, KV, HD, I, V, VD = 32, 4, 2, 8, 48, 64, 24


def write_head(path, fmt: str, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    layer = {"q_proj": r(HEADS * HD, 2 * H), "k_proj": r(KV * HD, 2 * H), "v_proj": r(KV * HD, 2 * H),
             "o_proj": r(H, HEADS * HD)}
    w = {f"self_attn.{k}.weight": v for k, v in layer.items()}
    w |= {"mlp.gate_proj.weight": r(I, H), "mlp.up_proj.weight": r(I, H), "mlp.down_proj.weight": r(H, I)}
    w |= {f"{n}.weight": 1 + r(H) for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
    prefix = "layers.0." if fmt == "speculators" else "midlayer."
    tensors = {prefix + k: v for k, v in w.items()}
    tensors |= {"fc.weight": r(H, 3 * H), "norm.weight": 1 + r(H), "lm_head.weight": r(VD, H),
                "d2t": torch.randint(0, V - VD, (VD,), generator=g), "t2d": torch.zeros(V, dtype=torch.bool)}
    if fmt == "speculators":
        tensors["embed_tokens.weight"] = r(V, H)
    llama = {"vocab_size": V, "hidden_size": H, "intermediate_size": I, "num_attention_heads": HEADS,
             "num_key_value_heads": KV, "head_dim": HD, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
             "rope_theta": 10000.0, "max_position_embeddings": 256}
    config = ({"speculators_model_type": "eagle3", "transformer_layer_config": llama, "draft_vocab_size": VD,
               "norm_before_residual": True} if fmt == "speculators"
              else {**llama, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": VD,
                    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 9]}})
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return tensors


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos):
    half = HD // 2
    inv = 1.0 / 10000.0 ** (torch.arange(half, dtype=torch.float32) * 2 / HD)
    ang = pos[:, None].float() * inv[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


def reference(t: dict, prefix: str, embed, ids, aux, norm_before_residual: bool):
    """The head's forward from the format's description: fc, [norm(embedding), norm(hidden)] into
    causal attention with RoPE, residual, SwiGLU MLP, final norm, lm_head, d2t."""
    w = {k[len(prefix):]: v for k, v in t.items() if k.startswith(prefix)}
    hidden = aux @ t["fc.weight"].T
    normed = rms(hidden, w["hidden_norm.weight"])
    x = torch.cat([rms(embed[ids], w["input_layernorm.weight"]), normed], -1)
    n = len(ids)
    q = (x @ w["self_attn.q_proj.weight"].T).view(n, HEADS, HD)
    k = (x @ w["self_attn.k_proj.weight"].T).view(n, KV, HD)
    v = (x @ w["self_attn.v_proj.weight"].T).view(n, KV, HD)
    pos = torch.arange(n)
    q, k = rope(q, pos), rope(k, pos)
    k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HD)
    scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, HEADS * HD)
    out = (normed if norm_before_residual else hidden) + attn @ w["self_attn.o_proj.weight"].T
    mlp_in = rms(out, w["post_attention_layernorm.weight"])
    gate, up = mlp_in @ w["mlp.gate_proj.weight"].T, mlp_in @ w["mlp.up_proj.weight"].T
    out = out + (torch.nn.functional.silu(gate) * up) @ w["mlp.down_proj.weight"].T
    draft = (rms(out, t["norm.weight"]) @ t["lm_head.weight"].T).argmax(-1)
    return draft + t["d2t"][draft], out


@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
def test_head_loads_and_equals_the_reference(tmp_path, fmt):
    tensors = write_head(tmp_path / fmt, fmt, seed=3)
    config = Eagle3Config.from_folder(str(tmp_path / fmt))
    assert config.draft_vocab_size == VD and config.norm_before_residual == (fmt == "speculators")
    assert config.aux_layers == (None if fmt == "speculators" else (2, 6, 10))  # SGLang ids: outputs of
    assert default_aux_layers(36) == (2, 18, 33)
    target_embed = torch.randn(V, H, generator=torch.Generator().manual_seed(9))
    with torch.device("cpu"), use_tp_group(TPGroup()):
        head = Eagle3Head(config, max_positions=256)
    load_head(head, str(tmp_path / fmt), target_embedding=target_embed)
    head.layers[0].self_attn.attn.backend = select_backend("cpu", 16)
    n = 11
    g = torch.Generator().manual_seed(int(fmt == "sglang"))
    ids, aux = torch.randint(0, V, (n,), generator=g), torch.randn(n, 3 * H, generator=g)
    meta = prefill_metadata([n], [n], torch.full((n,), -1, dtype=torch.int32), None, "cpu")
    with torch.inference_mode():
        got_ids, got_out = head(ids, torch.arange(n), aux, meta)
    embed = tensors.get("embed_tokens.weight", target_embed)
    prefix = "layers.0." if fmt == "speculators" else "midlayer."
    want_ids, want_out = reference(tensors, prefix, embed, ids, aux, fmt == "speculators")
    assert torch.allclose(got_out, want_out, atol=1e-5, rtol=1e-5), (got_out - want_out).abs().max()
    assert torch.equal(got_ids, want_ids)
    # A later draft step feeds the head's own output back (no fc): shape H.
    with torch.inference_mode():
        again, _ = head(ids, torch.arange(n), got_out, meta)
    assert again.shape == (n,)


def test_a_tensor_the_head_does_not_have_is_named(tmp_path):
    write_head(tmp_path / "h", "speculators", seed=1)
    from safetensors.torch import load_file

    t = load_file(str(tmp_path / "h" / "model.safetensors"))
    t["layers.0.extra.weight"] = torch.zeros(2)
    save_file(t, str(tmp_path / "h" / "model.safetensors"))
    with use_tp_group(TPGroup()):
        head = Eagle3Head(Eagle3Config.from_folder(str(tmp_path / "h")), max_positions=64)
    with pytest.raises(ValueError, match="layers.0.extra.weight"):
        load_head(head, str(tmp_path / "h"))


def test_the_decoder_keeps_the_residual_stream_entering_the_aux_layers(tmp_path):
    """What EAGLE-3 reads from the target: the inputs of the aux layers, equal to transformers'
    hidden_states[i] (the input of layer i) on the same float32 weights."""
    import sys, os  # noqa: E401

    sys.path.insert(0, os.path.dirname(__file__))
    import tiny_model as tm

    from nanovllm import LLM

    path = tm.make_tiny_qwen3(tmp_path / "t", num_layers=4)
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=16)
    model = llm.model_runner.model.model
    model.capture_layer_inputs((0, 2, 3))
    ids = list(range(5, 17))
    llm.model_runner.score(ids)  # one prefill of the sequence, no cache
    hf = tm.load_hf_model(path)
    with torch.inference_mode():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = torch.cat([states[i][0] for i in (0, 2, 3)], dim=-1)
    assert model.aux.shape == (12, 3 * 64) and torch.allclose(model.aux, want, atol=1e-5), \
        (model.aux - want).abs().max()
    with pytest.raises(ValueError, match="outside"):
        model.capture_layer_inputs((4,))
