"""EAGLE-3 in the engine (method "eagle3", features/speculative/eagle3.py) on CPU, float32.

A tiny random head (eagle3_reference.py) drafts for a tiny 4-layer Qwen3. Two checks:
- its drafts are EAGLE-3's: every proposal the engine makes equals the one a plain-torch
  reference computes from scratch (transformers' hidden states of the target for the sequence's
  tokens, the head's forward with full causal attention, k draft steps feeding its output back):
  this checks which target states, which tokens and which positions the paged head reads, after
  chunked prefills, rejections and kept drafts of every length (a target made to accept);
- the output is the target's: greedy and seeded sampling equal the engine without drafts, also
  with preemption, n = 2, mixed steps and prefix-cache hits.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import tiny_model as tm  # noqa: E402
from eagle3_reference import HeadShape, reference_drafts, write_head  # noqa: E402
from helpers import assert_idle, greedy, make_llm, rand_ids  # noqa: E402

from nanovllm import SamplingParams  # noqa: E402
from nanovllm.features.speculative.drafting import draft_counts  # noqa: E402
from nanovllm.features.speculative.eagle3 import Eagle3Proposer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# The inputs of target layers 0, 2, 3 (vLLM's convention); SGLang's file names the outputs of 0..2.
AUX = {"speculators": (0, 2, 3), "sglang": (0, 1, 2)}
PROMPTS = [rand_ids(37, 1), rand_ids(5, 2), rand_ids(21, 3) * 2]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tm.make_tiny_qwen3(tmp_path_factory.mktemp("eagle_target"), num_layers=4, seed=7)


@pytest.fixture(scope="module")
def zero_target(target, tmp_path_factory):
    """`target` with its final norm zeroed: all logits 0, so greedy always picks token 0 (the
    layers, whose inputs the head reads, are untouched). Heads whose d2t maps half their draft
    ids to 0 then see drafts kept, and rejected, at every position."""
    from helpers import copy_checkpoint

    path = copy_checkpoint(target, tmp_path_factory.mktemp("eagle_zero") / "t")
    tm.rewrite_tensors(path, lambda t: t.update({"model.norm.weight": torch.zeros_like(t["model.norm.weight"])}))
    return path


def shape_of(target: str) -> HeadShape:
    with open(os.path.join(target, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    return HeadShape(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, vocab=vocab, draft_vocab=40,
                     target_hidden=64)


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    """fmt -> (folder, tensors) of a random head for `target` in each format; d2t sends the first
    half of the draft ids to target id 0 (see zero_target)."""
    root, shape = tmp_path_factory.mktemp("eagle_heads"), shape_of(target)
    d2t = -torch.arange(shape.draft_vocab)
    d2t[shape.draft_vocab // 2:] = 7
    made = {}
    for i, fmt in enumerate(AUX):
        folder = root / fmt
        tensors = write_head(folder, fmt, seed=i, shape=shape, aux_ids=AUX[fmt])
        tensors["d2t"] = d2t
        tm.rewrite_tensors(folder, lambda t: t.update({"d2t": d2t}))
        made[fmt] = (str(folder), tensors)
    return made


def eagle(head: str, k: int = 3, **extra) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k, **extra}


def tokens(outputs) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


@pytest.fixture
def recorded(monkeypatch):
    """Every proposal the EAGLE-3 proposer makes: (the sequence's tokens, k, its drafts)."""
    calls = []
    propose = Eagle3Proposer.propose

    def record(self, seqs, ks, block_manager):
        out = propose(self, seqs, ks, block_manager)
        calls.extend((list(s.token_ids), k, d) for s, k, d in zip(seqs, ks, out))
        return out
    monkeypatch.setattr(Eagle3Proposer, "propose", record)
    return calls


@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
@pytest.mark.parametrize("zeroed", [False, True])
def test_the_engines_drafts_are_eagle3s(target, zero_target, heads, recorded, fmt, zeroed):
    path, tensors = heads[fmt]
    model = zero_target if zeroed else target
    llm = make_llm(model, speculative_config=eagle(path), max_num_batched_tokens=32)
    llm.generate(PROMPTS, greedy(20), use_tqdm=False)  # (the 37- and 42-token prompts are chunked)
    hf = tm.load_hf_model(model)
    aux = [i + 1 for i in AUX[fmt]] if fmt == "sglang" else list(AUX[fmt])
    prefix = "layers.0." if fmt == "speculators" else "midlayer."
    embed = hf.model.embed_tokens.weight.detach()  # (the target's replaces a head's own, as in vLLM)
    assert sum(1 for _, _, d in recorded if d) >= 15
    c = draft_counts(llm.scheduler)
    if zeroed:  # drafts kept (half the draft ids are the target's token) and rejected at every position
        assert c.accepted_per_position[2] > 0 and c.num_accepted_tokens < c.num_draft_tokens
    for seq_tokens, k, drafts in recorded:
        if not drafts:
            continue  # (no row kept for it: its last step was skipped)
        with torch.inference_mode():
            states = hf(torch.tensor([seq_tokens]), output_hidden_states=True).hidden_states
        target_aux = torch.cat([states[i][0] for i in aux], dim=-1)
        want = reference_drafts(tensors, prefix, embed, seq_tokens, target_aux, k, fmt == "speculators",
                                shape_of(target))
        assert drafts == want, (len(seq_tokens), drafts, want)
    assert_idle(llm)


def test_greedy_and_seeded_sampling_are_the_targets(target, heads):
    """Preemption (a small cache: the head's K/V recomputed with the target's), n = 2, mixed
    steps, prefix hits (the second run) and chunked prompts: equal to the engine without drafts."""
    kw = dict(num_kvcache_blocks=14, mixed_steps=True, max_num_batched_tokens=32)
    base = make_llm(target, **kw)
    llm = make_llm(target, speculative_config=eagle(heads["sglang"][0], k=2), **kw)
    prompts = PROMPTS + [rand_ids(20, 9)]
    params = SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=30, ignore_eos=True)
    want = tokens(base.generate(prompts, params, use_tqdm=False))
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    assert tokens(llm.generate(prompts, greedy(25), use_tqdm=False)) == tokens(
        base.generate(prompts, greedy(25), use_tqdm=False))
    assert llm.scheduler.num_preemptions > 0 and llm.block_manager.num_prefix_hit_tokens > 0
    assert draft_counts(llm.scheduler).num_drafts > 20
    assert_idle(llm)


def test_the_kv_budget_charges_the_heads_layer(target, heads):
    """On the CPU the cache has a fixed budget: the head's one layer beside the target's four
    takes a fifth of each block."""
    from nanovllm import LLM

    plain = LLM(target, kvcache_block_size=16)
    spec = LLM(target, kvcache_block_size=16, speculative_config=eagle(heads["speculators"][0]))
    assert spec.block_manager.num_blocks == plain.block_manager.num_blocks * 4 // 5
    proposer = spec.scheduler.hooks[0].proposer
    assert proposer.kv_cache.shape[2] == spec.block_manager.num_blocks
    plain.shutdown()
    spec.shutdown()


def test_bad_eagle3_configs_are_clear_errors(target, heads, tmp_path):
    head = heads["speculators"][0]
    with pytest.raises(ValueError, match="needs 'model'"):
        make_llm(target, speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="EAGLE-3 head"):
        make_llm(target, speculative_config=eagle(target))  # a 4-layer model is not a head
    small = tm.make_tiny_qwen3(tmp_path / "small", num_layers=2)
    with pytest.raises(ValueError, match="target layers"):
        make_llm(small, speculative_config=eagle(head))  # it reads layer 3
    other = tmp_path / "other"
    write_head(other, "speculators", seed=4, shape=HeadShape(vocab=shape_of(target).vocab, target_hidden=32))
    with pytest.raises(ValueError, match="target hidden size"):
        make_llm(target, speculative_config=eagle(str(other)))
    with pytest.raises(NotImplementedError, match="tensor_parallel_size"):
        make_llm(target, tensor_parallel_size=2, speculative_config=eagle(head))
