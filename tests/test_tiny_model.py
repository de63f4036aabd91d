"""Checks for the locally generated tiny Qwen3 checkpoints (tests/tiny_model.py)."""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import tiny_model as tm  # noqa: E402

PROMPTS = [
    "Hello, world!",
    "def add(a, b):\n    return",
    "你好，世界。",
    "The capital of France is",
    "Once upon a time there was",
    "Café crème 😀",
]


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tm.make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="module")
def tokenizer(ckpt_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt_dir)


@pytest.fixture(scope="module")
def hf_model(ckpt_dir):
    return tm.load_hf_model(ckpt_dir)


# ------------------------------------------------------------------------------------------
# Checkpoint files and config
# ------------------------------------------------------------------------------------------


def test_checkpoint_files(ckpt_dir):
    files = set(os.listdir(ckpt_dir))
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    } <= files
    assert not any(f.endswith((".bin", ".pt", ".pth", ".pkl")) for f in files)
    tok_cfg = json.load(open(os.path.join(ckpt_dir, "tokenizer_config.json")))
    assert tok_cfg["chat_template"] == tm.CHAT_TEMPLATE
    assert tok_cfg["eos_token"] == "<|im_end|>"
    assert tok_cfg["pad_token"] == "<|endoftext|>"


def test_without_tokenizer(tmp_path):
    path = tm.make_tiny_qwen3(tmp_path / "m", with_tokenizer=False)
    files = set(os.listdir(path))
    assert "model.safetensors" in files and "config.json" in files
    assert "tokenizer.json" not in files


def test_deterministic(tmp_path):
    a = tm.make_tiny_qwen3(tmp_path / "a")
    b = tm.make_tiny_qwen3(tmp_path / "b")
    for name in sorted(os.listdir(a)):
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            assert fa.read() == fb.read(), name
    c = tm.make_tiny_qwen3(tmp_path / "c", seed=1, with_tokenizer=False)
    with open(os.path.join(a, "model.safetensors"), "rb") as fa, open(os.path.join(c, "model.safetensors"), "rb") as fc:
        assert fa.read() != fc.read()


@pytest.mark.parametrize("name", sorted(tm.CONFIGS))
def test_named_configs_round_trip(tmp_path, name):
    from safetensors import safe_open
    from transformers import AutoConfig

    kwargs = tm.CONFIGS[name]
    path = tm.make_tiny_qwen3(tmp_path / name, **kwargs)
    raw = json.load(open(os.path.join(path, "config.json")))
    assert raw["architectures"] == ["Qwen3ForCausalLM"]
    assert raw["model_type"] == "qwen3"
    assert raw["dtype"] == "float32" and raw["torch_dtype"] == "float32"
    assert raw["head_dim"] == kwargs.get("head_dim", 16)
    assert raw["rope_theta"] == 10000.0

    cfg = AutoConfig.from_pretrained(path)
    assert cfg.num_attention_heads == kwargs.get("num_heads", 4)
    assert cfg.num_key_value_heads == kwargs.get("num_kv_heads", 2)
    assert cfg.num_hidden_layers == kwargs.get("num_layers", 2)
    assert cfg.head_dim == kwargs.get("head_dim", 16)
    assert cfg.hidden_size == 64
    assert cfg.intermediate_size == 128
    assert cfg.tie_word_embeddings == kwargs.get("tie_word_embeddings", False)
    assert cfg.vocab_size == kwargs.get("vocab_size", raw["vocab_size"])
    assert cfg.vocab_size % 2 == 1
    assert cfg.vocab_size >= tm.TOKENIZER_VOCAB_SIZE
    assert cfg.rope_parameters["rope_theta"] == 10000.0

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        emb = f.get_tensor("model.embed_tokens.weight")
    assert emb.shape == (cfg.vocab_size, 64)
    assert emb.dtype == torch.float32
    assert ("lm_head.weight" in keys) != cfg.tie_word_embeddings
    q = "model.layers.0.self_attn.q_proj.weight"
    k = "model.layers.0.self_attn.k_proj.weight"
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert f.get_slice(q).get_shape() == [cfg.num_attention_heads * cfg.head_dim, 64]
        assert f.get_slice(k).get_shape() == [cfg.num_key_value_heads * cfg.head_dim, 64]
    assert "model.layers.0.self_attn.q_norm.weight" in keys

    model = tm.load_hf_model(path)
    assert not model.training
    out = model(torch.tensor([[1, 2, 3]])).logits
    assert out.shape == (1, 3, cfg.vocab_size)
    assert torch.isfinite(out).all()


def test_generation_config(ckpt_dir):
    ids = tm.special_token_ids()
    gen = json.load(open(os.path.join(ckpt_dir, "generation_config.json")))
    assert gen["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert gen["pad_token_id"] == ids["<|endoftext|>"]
    assert gen["bos_token_id"] == ids["<|endoftext|>"]
    cfg = json.load(open(os.path.join(ckpt_dir, "config.json")))
    assert cfg["eos_token_id"] == ids["<|im_end|>"]


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "bfloat16"), (torch.float16, "float16")])
def test_dtype(tmp_path, dtype, name):
    from safetensors import safe_open

    path = tm.make_tiny_qwen3(tmp_path / name, dtype=dtype, with_tokenizer=False)
    raw = json.load(open(os.path.join(path, "config.json")))
    assert raw["dtype"] == name and raw["torch_dtype"] == name
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        for key in f.keys():
            assert f.get_tensor(key).dtype == dtype, key


# ------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------


def test_special_token_ids(tokenizer):
    ids = tm.special_token_ids()
    assert ids == {"<|endoftext|>": 512, "<|im_start|>": 513, "<|im_end|>": 514, "<think>": 515, "</think>": 516}
    assert len(tokenizer) == tm.TOKENIZER_VOCAB_SIZE
    for tok, i in ids.items():
        assert tokenizer.convert_tokens_to_ids(tok) == i
        assert tokenizer.encode(tok, add_special_tokens=False) == [i]
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == ids["<|im_end|>"]
    assert tokenizer.pad_token_id == ids["<|endoftext|>"]
    assert 400 <= len(tokenizer) <= 600


def test_tokenizer_round_trip(tokenizer):
    texts = [
        "naïve café, crème brûlée, Ærøskøbing, Łódź",
        "你好，世界！こんにちは 안녕하세요",
        "😀🚀 👍🏽 👨‍👩‍👧 🇫🇷",
        "def f(x):\n\treturn x ** 2  # square\r\n",
        "  leading and trailing spaces  ",
        "unseen: ZXQV ǅ ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u200b",
    ]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert all(0 <= i < tm.TOKENIZER_VOCAB_SIZE for i in ids)
        assert tokenizer.decode(ids) == text
    # BPE merges actually compress common text.
    assert len(tokenizer.encode("The quick brown fox", add_special_tokens=False)) < len("The quick brown fox")
    # Special tokens are atomic, and skipped on request; <think> is kept like in Qwen3.
    s = "<|im_start|>user\nhi<|im_end|>\n<think>x</think>"
    ids = tokenizer.encode(s, add_special_tokens=False)
    assert ids[0] == 513 and 514 in ids and 515 in ids and 516 in ids
    assert tokenizer.decode(ids) == s
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi\n<think>x</think>"
    # No BOS is added.
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)


def test_tokenizer_standalone(tmp_path):
    from transformers import AutoTokenizer

    tok = tm.make_tokenizer(tmp_path / "tok")
    files = set(os.listdir(tmp_path / "tok"))
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= files
    assert "chat_template.jinja" not in files
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    text = "Dvořák 東京 🎉"
    assert tok.encode(text) == loaded.encode(text)


def test_chat_template(tokenizer):
    msgs = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi!"}]
    base = "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    assert tokenizer.apply_chat_template(msgs, tokenize=False) == base
    assert tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        base + "<|im_start|>assistant\n"
    )
    assert tokenizer.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True, enable_thinking=True
    ) == base + "<|im_start|>assistant\n"
    assert tokenizer.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False
    ) == base + "<|im_start|>assistant\n<think>\n\n</think>\n\n"

    # Multi-turn: reasoning of earlier assistant turns is dropped, like Qwen3.
    multi = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"},
    ]
    assert tokenizer.apply_chat_template(multi, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    # Final assistant turn keeps its reasoning.
    assert tokenizer.apply_chat_template(multi[:2], tokenize=False) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4<|im_end|>\n"
    )

    # Tokenized form (transformers 5.x returns a BatchEncoding unless return_dict=False).
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert isinstance(ids, list) and isinstance(ids[0], int)
    assert ids[0] == tm.special_token_ids()["<|im_start|>"]
    assert tokenizer.decode(ids) == base + "<|im_start|>assistant\n"


# ------------------------------------------------------------------------------------------
# Reference generation
# ------------------------------------------------------------------------------------------


def test_hf_greedy_length(hf_model, tokenizer):
    for n in (1, 7, 20):
        out = tm.hf_greedy(hf_model, tokenizer.encode("Hello, world!"), n)
        assert len(out) == n
        assert all(isinstance(t, int) and 0 <= t < hf_model.config.vocab_size for t in out)


def test_hf_greedy_matches_manual_argmax(hf_model, tokenizer):
    prompt = tokenizer.encode("The capital of France is")
    out = tm.hf_greedy(hf_model, prompt, 8)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            logits = hf_model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    assert out == ids[len(prompt):]


def test_hf_greedy_ignores_eos(ckpt_dir, tokenizer):
    """Make EOS the greedy choice for the first step: generation must still run to max_new_tokens."""
    model = tm.load_hf_model(ckpt_dir)
    prompt = tokenizer.encode("Hello, world!")
    first = tm.hf_greedy(model, prompt, 1)[0]
    eos = tm.special_token_ids()["<|im_end|>"]
    if first != eos:
        with torch.no_grad():
            w = model.lm_head.weight
            w[[first, eos]] = w[[eos, first]].clone()
    out = tm.hf_greedy(model, prompt, 10)
    assert out[0] == eos
    assert len(out) == 10
    # Model's own generation config is untouched.
    assert model.generation_config.eos_token_id == [eos, tm.special_token_ids()["<|endoftext|>"]]


def test_greedy_not_degenerate(hf_model, tokenizer):
    outs = [tm.hf_greedy(hf_model, tokenizer.encode(p), 12) for p in PROMPTS]
    firsts = {o[0] for o in outs}
    assert len(firsts) >= 3, outs
    for o in outs:
        assert len(set(o)) >= 4, o  # no single-token loop
    assert len({tuple(o) for o in outs}) == len(outs)


@pytest.mark.parametrize("name", sorted(tm.CONFIGS))
def test_logit_gaps(tmp_path, tokenizer, name):
    """Top-1 vs top-2 logit gaps should be comfortably above float noise for most positions."""
    path = tm.make_tiny_qwen3(tmp_path / name, with_tokenizer=False, **tm.CONFIGS[name])
    model = tm.load_hf_model(path)
    gaps = []
    with torch.no_grad():
        for p in PROMPTS:
            logits = model(torch.tensor([tokenizer.encode(p)])).logits[0]
            top2 = logits.topk(2, dim=-1).values
            gaps.append(top2[:, 0] - top2[:, 1])
            # logits are spread out, not near-constant
            assert logits.std(dim=-1).min() > 0.5
    gaps = torch.cat(gaps)
    assert (gaps > 1e-3).float().mean() >= 0.9, gaps
    # greedy continuation is non-degenerate for every named config too
    outs = [tm.hf_greedy(model, tokenizer.encode(p), 8) for p in PROMPTS[:3]]
    assert len({o[0] for o in outs}) >= 2 or len({t for o in outs for t in o}) >= 6, outs


def test_cached_path():
    a = tm.tiny_qwen3_path("mqa")
    assert tm.tiny_qwen3_path("mqa") == a
    b = tm.tiny_qwen3_path("mqa", seed=3)
    assert b != a
    assert json.load(open(os.path.join(a, "config.json")))["num_key_value_heads"] == 1
