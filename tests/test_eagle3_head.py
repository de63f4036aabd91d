"""EAGLE-3 heads (features/speculative/eagle3_head.py): tiny random heads written in the
speculators format and in SGLang's (`midlayer`, no embedding: the target's is used) load, and
their forward equals a plain-torch one written from the formats' description (eagle3_reference.py;
float32 on the CPU, the same operations in another order: within 1e-5)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from safetensors.torch import save_file

from nanovllm.features.speculative.eagle3_head import Eagle3Config, Eagle3Head, default_aux_layers, load_head
from nanovllm.model.attention import prefill_metadata
from nanovllm.model.attention.selection import select_backend
from nanovllm.parallel.group import TPGroup, use_tp_group

sys.path.insert(0, os.path.dirname(__file__))
from eagle3_reference import HeadShape, draft_ids, head_forward, write_head  # noqa: E402

SHAPE = HeadShape()
H, V = SHAPE.hidden, SHAPE.vocab


@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
def test_head_loads_and_equals_the_reference(tmp_path, fmt):
    tensors = write_head(tmp_path / fmt, fmt, seed=3, aux_ids=None if fmt == "speculators" else (1, 5, 9))
    config = Eagle3Config.from_folder(str(tmp_path / fmt))
    assert config.draft_vocab_size == SHAPE.draft_vocab and config.norm_before_residual == (fmt == "speculators")
    assert config.aux_layers == (None if fmt == "speculators" else (2, 6, 10))  # SGLang ids: outputs of
    assert default_aux_layers(36) == (2, 18, 33)
    target_embed = torch.randn(V, H, generator=torch.Generator().manual_seed(9))
    with torch.device("cpu"), use_tp_group(TPGroup()):
        head = Eagle3Head(config, max_positions=256)
    # The speculators file carries its embedding; SGLang's reads the target's.
    load_head(head, str(tmp_path / fmt), target_embedding=None if fmt == "speculators" else target_embed)
    head.layers[0].self_attn.attn.backend = select_backend("cpu", 16)
    n = 11
    g = torch.Generator().manual_seed(int(fmt == "sglang"))
    ids, aux = torch.randint(0, V, (n,), generator=g), torch.randn(n, 3 * H, generator=g)
    meta = prefill_metadata([n], [n], torch.full((n,), -1, dtype=torch.int32), None, "cpu")
    with torch.inference_mode():
        got_out = head(ids, torch.arange(n), aux, meta)
        got_ids = head.draft_tokens(got_out)
    embed = tensors.get("embed_tokens.weight", target_embed)
    prefix = "layers.0." if fmt == "speculators" else "midlayer."
    want_out = head_forward(tensors, prefix, embed, ids, aux @ tensors["fc.weight"].T, fmt == "speculators")
    want_ids = draft_ids(tensors, want_out)
    assert torch.allclose(got_out, want_out, atol=1e-5, rtol=1e-5), (got_out - want_out).abs().max()
    assert torch.equal(got_ids, want_ids)
    # A later draft step feeds the head's own output back (no fc): shape H.
    with torch.inference_mode():
        again = head(ids, torch.arange(n), got_out, meta)
    assert again.shape == (n, H)


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


def test_a_head_without_an_embedding_needs_the_targets(tmp_path):
    write_head(tmp_path / "h", "sglang", seed=2)
    with use_tp_group(TPGroup()):
        head = Eagle3Head(Eagle3Config.from_folder(str(tmp_path / "h")), max_positions=64)
    with pytest.raises(ValueError, match="no embed_tokens"):
        load_head(head, str(tmp_path / "h"))


def test_the_layer_inputs_are_the_residual_stream_entering_those_layers(tmp_path):
    """What EAGLE-3 reads from the target (layer_inputs.py): the inputs of the chosen layers,
    equal to transformers' hidden_states[i] (the input of layer i) on the same float32 weights."""
    import tiny_model as tm

    from nanovllm import LLM
    from nanovllm.features.speculative.layer_inputs import LayerInputs

    path = tm.make_tiny_qwen3(tmp_path / "t", num_layers=4)
    llm = LLM(path, kvcache_block_size=16, num_kvcache_blocks=16)
    kept = LayerInputs(llm.model_runner.model.model, (0, 3, 2, 3), max_tokens=16)
    kept.buffer.fill_(float("nan"))  # poisoned: the forward must write every row it keeps
    ids = list(range(5, 17))
    llm.model_runner.score(ids)  # one prefill of the sequence, no cache
    hf = tm.load_hf_model(path)
    with torch.inference_mode():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = torch.cat([states[i][0] for i in (0, 3, 2, 3)], dim=-1)
    got = kept.rows(12)
    assert got.shape == (12, 4 * 64) and torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    with pytest.raises(ValueError, match="must be some of 0..3"):
        LayerInputs(llm.model_runner.model.model, (4,), max_tokens=16)
