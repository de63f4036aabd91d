"""End-to-end tests of `LLM` on tiny random Qwen3 checkpoints, compared with transformers (CPU, fp32).

1. greedy tokens equal transformers' for prompts of 1 token, exactly one block, several blocks + 1;
2. the same through prefix-cache hits, chunked prefill, no prefix caching, preemption, one sequence;
3. teacher-forced logits of every position (prefill, prefill chunks, prefix-hit tails, decode)
   equal transformers' to 1e-4;
4. every bad input of SPEC.md raises a clear exception before any work starts, and the `LLM` still
   generates correctly afterwards;
5. the output format.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers import (  # noqa: E402
    BLOCK,
    EOS_IDS,
    assert_idle,
    copy_checkpoint,
    edit_json,
    greedy,
    hf_logits,
    hf_reference,
    make_llm,
    rand_ids,
    rewrite_safetensors,
    tiny_checkpoint,
)

from nanovllm import LLM, SamplingParams  # noqa: E402

ALL_CONFIGS = ["gqa", "mqa", "tied", "odd_vocab", "wide_heads"]


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory, "gqa")


def vocab_size(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["vocab_size"]


def assert_matches_hf(path, prompts, outputs, max_tokens):
    assert len(outputs) == len(prompts)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        ref = hf_reference(path, prompt, max_tokens)
        assert out["token_ids"] == ref, f"prompt {i} ({len(prompt)} tokens): engine {out['token_ids']} != hf {ref}"
        assert out["finish_reason"] == "length"


# ============================================================================================
# 1. Greedy tokens equal transformers'
# ============================================================================================


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_greedy_matches_transformers(tmp_path_factory, name):
    path = tiny_checkpoint(tmp_path_factory, name)
    high = vocab_size(path)  # odd_vocab: also ids past the tokenizer's vocabulary
    prompts = [rand_ids(1, 1, high), rand_ids(BLOCK, 2, high), rand_ids(3 * BLOCK + 1, 3, high),
               rand_ids(7, 4, high), [high - 1, 0, high - 2]]
    llm = make_llm(path)
    # 20 tokens: the 1-token and the one-block prompts cross a block boundary while decoding.
    outputs = llm.generate(prompts, greedy(20), use_tqdm=False)
    assert_matches_hf(path, prompts, outputs, 20)
    assert_idle(llm)


# ============================================================================================
# 2. Prefix caching, chunked prefill, no prefix caching, preemption, max_num_seqs=1
# ============================================================================================


def test_prefix_cache_hits_give_the_same_tokens(gqa):
    common = rand_ids(40, 10)
    prompts = [common + rand_ids(5, 11), common + rand_ids(9, 12),
               rand_ids(2 * BLOCK, 13), rand_ids(2 * BLOCK, 13),  # the same prompt twice, exactly 2 blocks
               rand_ids(3, 14)]
    llm = make_llm(gqa)
    bm = llm.block_manager
    first = llm.generate(prompts, greedy(12), use_tqdm=False)
    assert_matches_hf(gqa, prompts, first, 12)
    hits_first = bm.num_prefix_hit_tokens

    second = llm.generate(prompts, greedy(12), use_tqdm=False)  # hits the blocks of the first run
    assert_matches_hf(gqa, prompts, second, 12)
    hits_second = bm.num_prefix_hit_tokens - hits_first
    # prompts 0, 1 (shared prefix and their own full blocks) and 2, 3 (a full block each) hit.
    assert hits_second >= 2 * BLOCK + 2 * BLOCK + BLOCK + BLOCK, hits_second

    # A follow-up turn: prompt 0 + its output + new tokens. Its first 3 blocks (48 tokens, some of
    # them generated ones) were computed by the earlier runs.
    follow_up = prompts[0] + first[0]["token_ids"] + rand_ids(3, 15)
    before = bm.num_prefix_hit_tokens
    out = llm.generate([follow_up], greedy(10), use_tqdm=False)
    assert_matches_hf(gqa, [follow_up], out, 10)
    assert bm.num_prefix_hit_tokens - before >= 3 * BLOCK
    assert_idle(llm)


@pytest.mark.parametrize("budget", [8, 20])
def test_chunked_prefill(gqa, budget):
    prompts = [rand_ids(40, 20), rand_ids(40, 21), rand_ids(1, 22), rand_ids(33, 23)]
    llm = make_llm(gqa, max_num_batched_tokens=budget)
    outputs = llm.generate(prompts, greedy(10), use_tqdm=False)
    assert_matches_hf(gqa, prompts, outputs, 10)
    # Again, now chunking the part after the prefix hits.
    outputs = llm.generate(prompts, greedy(10), use_tqdm=False)
    assert_matches_hf(gqa, prompts, outputs, 10)
    assert llm.block_manager.num_prefix_hit_tokens > 0
    assert_idle(llm)


def test_without_prefix_caching(gqa):
    common = rand_ids(40, 30)
    prompts = [common + rand_ids(4, 31), common + rand_ids(4, 32), rand_ids(2 * BLOCK, 33), rand_ids(2 * BLOCK, 33)]
    llm = make_llm(gqa, enable_prefix_caching=False)
    for _ in range(2):
        outputs = llm.generate(prompts, greedy(10), use_tqdm=False)
        assert_matches_hf(gqa, prompts, outputs, 10)
    assert llm.block_manager.num_prefix_hit_tokens == 0
    assert_idle(llm)


@pytest.mark.parametrize("options", [
    dict(),
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=8),
], ids=["prefix_caching", "no_prefix_caching", "chunked"])
def test_preemption_gives_the_same_tokens(gqa, options):
    # 8 blocks of 16 tokens; 4 requests of 30 + 30 tokens need 4 blocks each at the end.
    prompts = [rand_ids(30, 40 + i) for i in range(4)]
    llm = make_llm(gqa, num_kvcache_blocks=8, **options)
    outputs = llm.generate(prompts, greedy(30), use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    assert_matches_hf(gqa, prompts, outputs, 30)
    assert_idle(llm)


def test_one_sequence_at_a_time(gqa):
    common = rand_ids(2 * BLOCK + 5, 50)
    prompts = [common + rand_ids(3, 51), common + rand_ids(17, 52), rand_ids(1, 53)]
    llm = make_llm(gqa, max_num_seqs=1)
    outputs = llm.generate(prompts, greedy(12), use_tqdm=False)
    assert_matches_hf(gqa, prompts, outputs, 12)
    # Requests run one after the other, so the second one hits the first one's blocks.
    assert llm.block_manager.num_prefix_hit_tokens >= 2 * BLOCK
    assert_idle(llm)


# ============================================================================================
# 3. Teacher-forced logits equal transformers'
# ============================================================================================


def engine_logits(llm, prompt, max_tokens):
    """Generate greedily and return (output, logits of every row the model computed).

    A forward hook on the engine's model records the final hidden states of each step: the
    prompt's new tokens (all chunks), then one row per decode step. Teacher forcing is implicit:
    the reference is run on prompt + the engine's own generated tokens.
    """
    model = llm.model_runner.model
    rows = []
    handle = model.register_forward_hook(lambda mod, args, out: rows.append(out.detach().clone()))
    try:
        out = llm.generate([prompt], greedy(max_tokens), use_tqdm=False)[0]
    finally:
        handle.remove()
    with torch.inference_mode():
        logits = model.compute_logits(torch.cat(rows)).float()
    return out, logits


def assert_logits_close(ours, ref):
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("budget", [None, BLOCK, 21, 7], ids=["one_prefill", "chunks_16", "chunks_21", "chunks_7"])
@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_teacher_forced_logits_match_transformers(tmp_path_factory, name, budget):
    path = tiny_checkpoint(tmp_path_factory, name)
    prompt = rand_ids(40, 60)
    options = dict(enable_prefix_caching=False, enforce_eager=True)
    if budget is not None:
        options["max_num_batched_tokens"] = budget  # the later chunks attend to the earlier ones' cached K/V
    llm = make_llm(path, **options)
    out, ours = engine_logits(llm, prompt, 10)
    full = prompt + out["token_ids"][:-1]  # every token the engine fed to the model
    assert_logits_close(ours, hf_logits(path, full))


@pytest.mark.parametrize("name", ["gqa", "tied"])
def test_teacher_forced_logits_after_prefix_hits(tmp_path_factory, name):
    path = tiny_checkpoint(tmp_path_factory, name)
    prompt = rand_ids(45, 61)
    llm = make_llm(path, enforce_eager=True)
    llm.generate([prompt], greedy(4), use_tqdm=False)
    hits = llm.block_manager.num_prefix_hit_tokens
    out, ours = engine_logits(llm, prompt, 8)
    hits = llm.block_manager.num_prefix_hit_tokens - hits
    assert hits >= 2 * BLOCK
    full = prompt + out["token_ids"][:-1]
    assert_logits_close(ours, hf_logits(path, full)[hits:])


# ============================================================================================
# 4. Bad input
# ============================================================================================

MAX_MODEL_LEN = 128
CACHE_BLOCKS = 4  # 64 tokens: less than max_model_len, so some requests can never fit the cache
SHORT_LEN = 32  # max_model_len of `short_llm`, whose cache is large
REF_PROMPTS = [rand_ids(5, 100), rand_ids(20, 101)]  # with 8 new tokens: fit both engines


@pytest.fixture(scope="module")
def strict_llm(gqa):
    return make_llm(gqa, max_model_len=MAX_MODEL_LEN, num_kvcache_blocks=CACHE_BLOCKS)


@pytest.fixture(scope="module")
def short_llm(gqa):
    return make_llm(gqa, max_model_len=SHORT_LEN)


def assert_still_works(llm, path):
    assert_idle(llm)
    outputs = llm.generate(REF_PROMPTS, greedy(8), use_tqdm=False)
    assert_matches_hf(path, REF_PROMPTS, outputs, 8)
    assert_idle(llm)


def _count_runs(monkeypatch, llm) -> list:
    calls = []
    real = llm.model_runner.launch

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(llm.model_runner, "launch", counting)
    return calls


def _sp(**kw):
    return SamplingParams(temperature=0.0, **kw)


# name -> (function of the vocabulary size V giving (prompts, sampling_params), exception, message regex)
BAD_REQUESTS = {
    "empty_str": (lambda V: ("", _sp(max_tokens=4)), ValueError, r"(?i)empty"),
    "empty_str_in_list": (lambda V: (["Hello", ""], _sp(max_tokens=4)), ValueError, r"(?i)empty"),
    "empty_ids": (lambda V: ([[]], _sp(max_tokens=4)), ValueError, r"(?i)empty"),
    "empty_ids_in_batch": (lambda V: ([[1, 2], []], _sp(max_tokens=4)), ValueError, r"(?i)empty"),
    "negative_id": (lambda V: ([[1, 2, -1]], _sp(max_tokens=4)), ValueError, r"(?i)-1\b.*vocab"),
    "id_equal_to_vocab_size": (lambda V: ([[1, V, 2]], _sp(max_tokens=4)), ValueError, r"(?i)\bV\b.*vocab"),
    "id_far_past_vocab": (lambda V: ([[10**12]], _sp(max_tokens=4)), ValueError, r"(?i)1000000000000.*vocab"),
    "prompt_longer_than_max_model_len": (
        lambda V: ([rand_ids(SHORT_LEN + 1, 1)], _sp(max_tokens=1)), ValueError, r"max_model_len", "short"),
    "prompt_plus_max_tokens_past_max_model_len": (
        lambda V: ([rand_ids(SHORT_LEN - 7, 2)], _sp(max_tokens=8)), ValueError, r"max_model_len", "short"),
    "prompt_plus_max_tokens_never_fit_kv_cache": (
        lambda V: ([rand_ids(40, 3)], _sp(max_tokens=40)), ValueError, r"KV"),
    "prompt_alone_never_fits_kv_cache": (
        lambda V: ([rand_ids(CACHE_BLOCKS * BLOCK + 6, 4)], _sp(max_tokens=1)), ValueError, r"KV"),
    "too_few_sampling_params": (
        lambda V: ([[1], [2], [3]], [_sp(max_tokens=2)] * 2), ValueError, r"SamplingParams|sampling_params"),
    "too_many_sampling_params": (
        lambda V: ([[1], [2]], [_sp(max_tokens=2)] * 3), ValueError, r"SamplingParams|sampling_params"),
    "sampling_params_wrong_type": (lambda V: ([[1]], {"temperature": 0}), TypeError, r"sampling_params|SamplingParams"),
    "sampling_params_list_of_wrong_type": (lambda V: ([[1]], [None]), TypeError, r"SamplingParams|sampling_params"),
    "prompt_int": (lambda V: (42, _sp(max_tokens=2)), TypeError, r"(?i)prompt"),
    "prompt_none": (lambda V: (None, _sp(max_tokens=2)), TypeError, r"(?i)prompt"),
    # vLLM's {"prompt": ...} / {"prompt_token_ids": ...} dicts are prompts (the outputs issue);
    # a dict with neither is not.
    "prompt_dict": (lambda V: ({"text": "hi"}, _sp(max_tokens=2)), TypeError, r"(?i)prompt"),
    "prompt_dict_without_text_or_ids": (lambda V: ([{}], _sp(max_tokens=2)), TypeError, r"(?i)prompt"),
    "prompt_bytes": (lambda V: ([b"hello"], _sp(max_tokens=2)), TypeError, r"(?i)prompt"),
    "float_token_ids": (lambda V: ([[1.0, 2.0]], _sp(max_tokens=2)), TypeError, r"(?i)prompt|token"),
    "bool_token_ids": (lambda V: ([[True, False]], _sp(max_tokens=2)), TypeError, r"(?i)prompt|token"),
    "str_token_ids": (lambda V: ([["1", "2"]], _sp(max_tokens=2)), TypeError, r"(?i)prompt|token"),
    "nested_token_ids": (lambda V: ([[[1, 2]]], _sp(max_tokens=2)), TypeError, r"(?i)prompt|token"),
    "one_bad_prompt_in_a_mixed_batch": (
        lambda V: (["Hello", rand_ids(10, 5), [3, V + 5], "world"], _sp(max_tokens=4)), ValueError, r"(?i)vocab"),
    "lone_surrogate_in_a_text_prompt": (
        lambda V: (["Hello \ud800 world"], _sp(max_tokens=2)), ValueError, r"prompt 0: the prompt holds a lone "
        r"surrogate \(U\+D800\) at character 6"),
    "lone_surrogate_in_a_prompt_dict": (
        lambda V: ([{"prompt": "ok"}, {"prompt": "\udfff"}], _sp(max_tokens=2)), ValueError,
        r"prompt 1: .*lone surrogate \(U\+DFFF\)"),
    "lone_surrogate_in_a_bad_word": (
        lambda V: ([[1, 2]], _sp(max_tokens=2, bad_words=["fine", "x\udbff"])), ValueError,
        r"bad_words.*lone surrogate \(U\+DBFF\) at character 1"),
    "one_too_long_prompt_in_a_batch": (
        lambda V: ([rand_ids(10, 6), rand_ids(SHORT_LEN + 3, 7)], _sp(max_tokens=1)), ValueError,
        r"max_model_len", "short"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_raises_before_any_work_and_llm_stays_usable(strict_llm, short_llm, gqa, monkeypatch, case):
    make, exc, pattern, *kind = BAD_REQUESTS[case]
    llm = short_llm if kind == ["short"] else strict_llm
    V = llm.config.hf_config.vocab_size
    prompts, params = make(V)
    pattern = pattern.replace(r"\bV\b", rf"\b{V}\b")
    runs = _count_runs(monkeypatch, llm)
    with pytest.raises(exc, match=pattern):
        llm.generate(prompts, params, use_tqdm=False)
    assert runs == [], "the model ran before the bad input was rejected"
    assert_idle(llm)  # nothing was queued
    monkeypatch.undo()
    assert_still_works(llm, gqa)


def test_errors_never_echo_whole_inputs(strict_llm, gqa):
    """An error names the problem and quotes a few values, never a whole large input. Before:
    2.7 MB of message for 3x10^5 token ids outside the vocabulary."""
    llm = strict_llm
    V = llm.config.hf_config.vocab_size
    cases = [
        (lambda: llm.generate([[V + 1] * 300_000], _sp(max_tokens=2), use_tqdm=False),
         rf"token ids \[{V + 1}, {V + 1}, {V + 1}, {V + 1}, {V + 1}\] and 299995 more are outside the vocabulary"),
        (lambda: llm.generate([[1, 2]], _sp(max_tokens=2, allowed_token_ids=list(range(V, V + 200_000))),
                              use_tqdm=False),
         rf"allowed_token_ids: token ids \[{V}, {V + 1}, {V + 2}, {V + 3}, {V + 4}\] and 199995 more"),
        (lambda: llm.generate([[1, 2]], _sp(max_tokens=2, logit_bias={V + i: 1.0 for i in range(100_000)}),
                              use_tqdm=False), r"logit_bias: token ids .* and 99995 more"),
        (lambda: llm.generate([{"prompt": "hi", **{f"key{i}": 1 for i in range(100_000)}}], _sp(max_tokens=2),
                              use_tqdm=False), r"unknown prompt keys \['key0', .*\(100000 entries\)\]"),
        (lambda: llm.chat([{"role": "r" * 10**6, "content": "hi"}], _sp(max_tokens=2), use_tqdm=False),
         r"role must be one of .*, got 'r+'\.\.\. \(1000000 characters\)"),
        (lambda: llm.chat([{"role": "user", "content": "fine"}, {"role": "user", "content": "\ud800"}],
                          _sp(max_tokens=2), use_tqdm=False), r"message 1: content holds a lone surrogate"),
        (lambda: _sp(max_tokens=2, stop_token_ids=[-1] * 100_000), r"stop_token_ids=\[-1, .*\(100000 entries\)\]"),
    ]
    for call, pattern in cases:
        with pytest.raises((ValueError, TypeError), match=pattern) as e:
            call()
        assert len(str(e.value)) < 400, str(e.value)[:1000]
    assert_still_works(llm, gqa)


def test_max_model_len_is_inclusive(short_llm, gqa):
    """prompt + max_tokens == max_model_len is fine; one more token is not."""
    prompt = rand_ids(SHORT_LEN - 8, 110)
    out = short_llm.generate([prompt], greedy(8), use_tqdm=False)
    assert_matches_hf(gqa, [prompt], out, 8)
    with pytest.raises(ValueError, match="max_model_len"):
        short_llm.generate([prompt + [1]], greedy(8), use_tqdm=False)
    assert_idle(short_llm)


def test_unknown_keyword_arguments_are_named(gqa):
    with pytest.raises(TypeError) as info:
        LLM(gqa, kvcache_block_size=BLOCK, max_num_seq=4, tp_size=1)
    msg = str(info.value)
    assert "max_num_seq" in msg and "tp_size" in msg


@pytest.mark.parametrize("field,value", [
    ("kvcache_block_size", 24), ("kvcache_block_size", 8), ("kvcache_block_size", 0),
    ("gpu_memory_utilization", 0), ("gpu_memory_utilization", 1.5), ("gpu_memory_utilization", -0.2),
    ("max_num_seqs", 0), ("max_num_seqs", -3), ("max_num_batched_tokens", 0), ("max_model_len", 0),
    ("num_kvcache_blocks", 0), ("num_kvcache_blocks", -2), ("tensor_parallel_size", 0),
    ("tensor_parallel_size", 3),  # does not divide the 4 attention heads
    ("load_format", "pt"), ("device", "tpu"), ("dtype", "int8"), ("enforce_eager", "no"),
    ("enable_prefix_caching", None), ("seed", "0"), ("max_num_seqs", 2.5),
])
def test_invalid_llm_values(gqa, field, value):
    with pytest.raises((ValueError, TypeError), match=field):
        LLM(gqa, kvcache_block_size=BLOCK, **{field: value})


def _remove(*names):
    def edit(folder):
        for n in names:
            os.remove(os.path.join(folder, n))
    return edit


def _only_pickle(folder):
    from safetensors.torch import load_file

    torch.save(load_file(os.path.join(folder, "model.safetensors")), os.path.join(folder, "pytorch_model.bin"))
    os.remove(os.path.join(folder, "model.safetensors"))


def _config(**changes):
    def edit(folder):
        edit_json(os.path.join(folder, "config.json"), lambda c: c.update(changes))
    return edit


def _shrink(name, dim):
    def edit(folder):
        def fn(t):
            t[name] = t[name].narrow(dim, 0, t[name].shape[dim] - 1)
        rewrite_safetensors(folder, fn)
    return edit


def _drop(name):
    def edit(folder):
        def fn(t):
            del t[name]
        rewrite_safetensors(folder, fn)
    return edit


def _add(name, shape):
    def edit(folder):
        rewrite_safetensors(folder, lambda t: t.__setitem__(name, torch.zeros(shape)))
    return edit


# name -> (edit of a copy of the gqa checkpoint, exception, message regex)
BAD_CHECKPOINTS = {
    "no_config_json": (_remove("config.json"), FileNotFoundError, r"config\.json"),
    "no_safetensors": (_remove("model.safetensors"), FileNotFoundError, r"safetensors"),
    "only_a_pickle_checkpoint": (_only_pickle, FileNotFoundError, r"safetensors"),
    "no_tokenizer_files": (_remove("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"),
                           (ValueError, OSError), r"(?i)tokenizer"),
    "mistral_architecture": (_config(model_type="mistral", architectures=["MistralForCausalLM"]), ValueError,
                             r"MistralForCausalLM.*supported architectures: Qwen3ForCausalLM"),
    "mixtral_architecture": (_config(model_type="mixtral", architectures=["MixtralForCausalLM"]), ValueError,
                             r"MixtralForCausalLM"),
    "sliding_window": (_config(use_sliding_window=True, sliding_window=64), ValueError, r"sliding-window"),
    "qwen3_type_unknown_class": (_config(architectures=["Qwen3ForSequenceClassification"]), ValueError,
                                 r"Qwen3ForSequenceClassification"),
}
for _name, _dim in [("model.embed_tokens.weight", 0), ("model.embed_tokens.weight", 1), ("lm_head.weight", 0),
                    ("model.layers.0.self_attn.q_proj.weight", 0), ("model.layers.1.self_attn.k_proj.weight", 1),
                    ("model.layers.0.self_attn.v_proj.weight", 0), ("model.layers.0.self_attn.o_proj.weight", 1),
                    ("model.layers.1.mlp.gate_proj.weight", 0), ("model.layers.0.mlp.up_proj.weight", 1),
                    ("model.layers.0.mlp.down_proj.weight", 1), ("model.layers.0.self_attn.q_norm.weight", 0),
                    ("model.layers.1.input_layernorm.weight", 0), ("model.norm.weight", 0)]:
    BAD_CHECKPOINTS[f"wrong_shape:{_name}:{_dim}"] = (_shrink(_name, _dim), ValueError, re.escape(_name))
for _name in ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
              "model.layers.1.self_attn.k_proj.weight", "model.layers.0.self_attn.q_proj.weight",
              "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.down_proj.weight",
              "model.layers.0.self_attn.k_norm.weight"]:
    BAD_CHECKPOINTS[f"missing:{_name}"] = (_drop(_name), ValueError, re.escape(_name))
for _name, _shape in [("model.layers.0.self_attn.extra_proj.weight", (4, 4)),
                      ("model.layers.2.mlp.gate_proj.weight", (128, 64)), ("model.final_bias", (64,))]:
    BAD_CHECKPOINTS[f"unexpected:{_name}"] = (_add(_name, _shape), ValueError, re.escape(_name))
def _write(name, text):
    def edit(folder):
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    return edit


for _file in ("config.json", "generation_config.json"):
    BAD_CHECKPOINTS[f"broken_json:{_file}"] = (_write(_file, "{not json"), ValueError, re.escape(_file) + ".*not valid JSON")
    BAD_CHECKPOINTS[f"json_not_an_object:{_file}"] = (_write(_file, "[1, 2]"), ValueError,
                                                      re.escape(_file) + ".*JSON object")
BAD_CHECKPOINTS["config_has_more_layers_than_the_weights"] = (
    _config(num_hidden_layers=3, max_window_layers=3, layer_types=["full_attention"] * 3), ValueError,
    r"model\.layers\.2\.")


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_bad_checkpoint_raises_a_clear_error(gqa, tmp_path, case):
    edit, exc, pattern = BAD_CHECKPOINTS[case]
    folder = copy_checkpoint(gqa, tmp_path / "ckpt")
    edit(folder)
    with pytest.raises(exc, match=pattern):
        make_llm(folder)


def test_model_path_with_a_tilde_is_expanded(gqa, tmp_path, monkeypatch):
    copy_checkpoint(gqa, tmp_path / "ckpt")
    monkeypatch.setenv("HOME", str(tmp_path))
    llm = make_llm("~/ckpt")
    assert llm.config.model == str(tmp_path / "ckpt")
    llm.shutdown()


def test_missing_checkpoint_folder(tmp_path):
    missing = str(tmp_path / "no-such-checkpoint")
    with pytest.raises(FileNotFoundError, match="no-such-checkpoint"):
        make_llm(missing)
    with pytest.raises(FileNotFoundError, match="no-such-checkpoint"):
        make_llm("./no-such-checkpoint")


def test_checkpoint_errors_leave_other_engines_usable(gqa, tmp_path):
    llm = make_llm(gqa)
    folder = copy_checkpoint(gqa, tmp_path / "broken")
    _shrink("model.layers.0.self_attn.k_proj.weight", 0)(folder)
    with pytest.raises(ValueError, match=r"k_proj"):
        make_llm(folder)
    assert_still_works(llm, gqa)


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory):
    # Same seed and shape as `gqa`: identical weights, but no tokenizer files.
    return tiny_checkpoint(tmp_path_factory, "gqa", with_tokenizer=False)


def test_text_prompt_without_tokenizer(no_tokenizer, gqa, monkeypatch):
    llm = make_llm(no_tokenizer, skip_tokenizer_init=True)
    runs = _count_runs(monkeypatch, llm)
    for prompts in ("Hello", ["Hello"], [[1, 2, 3], "Hello"]):
        with pytest.raises(ValueError, match=r"(?i)token ids|tokenizer"):
            llm.generate(prompts, greedy(4), use_tqdm=False)
    assert runs == []
    assert_idle(llm)
    monkeypatch.undo()
    outputs = llm.generate(REF_PROMPTS, greedy(8), use_tqdm=False)
    assert_matches_hf(gqa, REF_PROMPTS, outputs, 8)
    assert all(o["text"] == "" for o in outputs)


# ============================================================================================
# 5. Output format
# ============================================================================================


@pytest.fixture(scope="module")
def llm(gqa):
    return make_llm(gqa)


@pytest.fixture(scope="module")
def tokenizer(gqa):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gqa)


TEXTS = ["Hello, world!", "The capital of France is", "def add(a, b):\n    return", "你好，世界。"]


def check_output(out, tokenizer):
    assert isinstance(out, dict)
    assert {"text", "token_ids", "finish_reason"} <= set(out)
    assert isinstance(out["text"], str)
    assert isinstance(out["token_ids"], list) and all(type(t) is int for t in out["token_ids"])
    assert out["finish_reason"] in ("stop", "length")
    assert out["text"] == tokenizer.decode(out["token_ids"], skip_special_tokens=True)


def test_text_prompts(llm, gqa, tokenizer):
    ids = [tokenizer.encode(t) for t in TEXTS]
    outputs = llm.generate(TEXTS, greedy(10), use_tqdm=False)
    assert isinstance(outputs, list) and len(outputs) == len(TEXTS)
    for out in outputs:
        check_output(out, tokenizer)
        assert len(out["token_ids"]) == 10
    assert_matches_hf(gqa, ids, outputs, 10)
    # One str is one prompt; token ids give the same as the text they encode.
    single = llm.generate(TEXTS[1], greedy(10), use_tqdm=False)
    assert isinstance(single, list) and len(single) == 1
    assert single[0]["token_ids"] == outputs[1]["token_ids"] and single[0]["text"] == outputs[1]["text"]
    by_ids = llm.generate(ids, greedy(10), use_tqdm=False)
    assert [o["token_ids"] for o in by_ids] == [o["token_ids"] for o in outputs]
    assert [o["text"] for o in by_ids] == [o["text"] for o in outputs]


def test_outputs_are_in_input_order(llm, gqa, tokenizer):
    prompts = [rand_ids(30, 70), rand_ids(2, 71), rand_ids(17, 72), rand_ids(5, 73)]
    lengths = [12, 2, 7, 1]  # requests finish in another order than they were given
    outputs = llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)
    assert [len(o["token_ids"]) for o in outputs] == lengths
    for p, n, out in zip(prompts, lengths, outputs):
        check_output(out, tokenizer)
        assert out["finish_reason"] == "length"
        assert out["token_ids"] == hf_reference(gqa, p, 12)[:n]


def test_use_tqdm_default_works(llm, gqa):
    out = llm.generate([REF_PROMPTS[0]], greedy(3))
    assert out[0]["token_ids"] == hf_reference(gqa, REF_PROMPTS[0], 3)


def _find_stop_case(path):
    """A prompt and an index k such that the greedy continuation's token k is new at k and no
    natural EOS comes before it."""
    for seed in range(200, 260):
        prompt = rand_ids(12, seed)
        ref = hf_reference(path, prompt, 20)
        for k in range(2, 15):
            if ref[k] in EOS_IDS or any(t in EOS_IDS for t in ref[:k]):
                break
            if ref[k] not in ref[:k]:
                return prompt, ref, k
    pytest.fail("no prompt found whose greedy continuation has a fresh token")


def test_finish_reason_stop_on_eos(gqa, tmp_path, tokenizer):
    prompt, ref, k = _find_stop_case(gqa)
    folder = copy_checkpoint(gqa, tmp_path / "eos")
    edit_json(os.path.join(folder, "generation_config.json"),
              lambda c: c.update(eos_token_id=list(EOS_IDS) + [ref[k]]))
    llm = make_llm(folder)
    out = llm.generate([prompt], greedy(20, ignore_eos=False), use_tqdm=False)[0]
    assert out["finish_reason"] == "stop"
    assert out["token_ids"] == ref[:k + 1]  # the EOS token ends the output and is kept
    assert isinstance(out["text"], str)
    # ignore_eos=True: runs to max_tokens.
    out = llm.generate([prompt], greedy(20, ignore_eos=True), use_tqdm=False)[0]
    assert out["finish_reason"] == "length" and out["token_ids"] == ref
    # max_tokens reached before the EOS.
    out = llm.generate([prompt], greedy(k, ignore_eos=False), use_tqdm=False)[0]
    assert out["finish_reason"] == "length" and out["token_ids"] == ref[:k]
    assert_idle(llm)


def test_finish_reason_stop_on_stop_token_ids(llm, gqa, tokenizer):
    prompt, ref, k = _find_stop_case(gqa)
    out = llm.generate([prompt], greedy(20, ignore_eos=False, stop_token_ids=[ref[k]]), use_tqdm=False)[0]
    assert out["finish_reason"] == "stop"
    assert out["token_ids"] == ref[:k + 1]
    check_output(out, tokenizer)
    # In a batch, only the request with the stop id stops early.
    outputs = llm.generate([prompt, prompt], [greedy(20, stop_token_ids=[ref[k]]), greedy(20)], use_tqdm=False)
    assert outputs[0]["token_ids"] == ref[:k + 1] and outputs[0]["finish_reason"] == "stop"
    assert outputs[1]["token_ids"] == ref and outputs[1]["finish_reason"] == "length"


def test_skip_tokenizer_init_with_token_ids(no_tokenizer, gqa):
    llm = make_llm(no_tokenizer, skip_tokenizer_init=True)
    assert llm.tokenizer is None
    prompts = [rand_ids(9, 80), rand_ids(BLOCK, 81)]
    outputs = llm.generate(prompts, greedy(10), use_tqdm=False)
    assert_matches_hf(gqa, prompts, outputs, 10)
    for out in outputs:
        assert out["text"] == ""
        assert {"text", "token_ids", "finish_reason"} <= set(out)
    # EOS ids still come from the checkpoint's config files without a tokenizer.
    assert set(EOS_IDS) <= set(llm.eos_token_ids)


def test_dummy_weights_generate_without_safetensors(gqa, tmp_path):
    folder = copy_checkpoint(gqa, tmp_path / "dummy")
    os.remove(os.path.join(folder, "model.safetensors"))
    llm = make_llm(folder, load_format="dummy")
    outputs = llm.generate([rand_ids(20, 90), "Hello"], greedy(5), use_tqdm=False)
    assert [len(o["token_ids"]) for o in outputs] == [5, 5]
    assert all(0 <= t < vocab_size(gqa) for o in outputs for t in o["token_ids"])


def test_numpy_token_ids_and_numbers_work_like_python_ones(llm):
    np = pytest.importorskip("numpy")
    prompts = [[5, 17, 3, 99], [42, 7]]
    want = llm.generate(prompts, greedy(5), use_tqdm=False)
    got = llm.generate([list(np.array(p)) for p in prompts], SamplingParams(temperature=0, max_tokens=np.int64(5)),
                       use_tqdm=False)
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in want]
    assert all(type(t) is int for o in got for t in o["prompt_token_ids"])
    # One prompt given as numpy token ids.
    assert llm.generate(list(np.array(prompts[1])), greedy(5), use_tqdm=False)[0]["token_ids"] == want[1]["token_ids"]


def test_top_k_past_int64_is_the_same_as_no_top_k(llm):
    prompts = [[5, 17, 3, 99], [42, 7]]
    off = [SamplingParams(temperature=0.8, seed=1, max_tokens=6), SamplingParams(temperature=0.8, seed=2, max_tokens=6)]
    huge = [SamplingParams(temperature=0.8, seed=1, max_tokens=6, top_k=2**70), SamplingParams(temperature=0.8, seed=2, max_tokens=6)]
    assert [o["token_ids"] for o in llm.generate(prompts, huge, use_tqdm=False)] == \
        [o["token_ids"] for o in llm.generate(prompts, off, use_tqdm=False)]
