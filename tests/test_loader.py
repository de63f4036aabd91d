"""Unit tests of weight loading (nanovllm/model/loader.py) into our Qwen3 model."""

from __future__ import annotations

import json
import os
import re
import sys
import weakref

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers import (  # noqa: E402
    copy_checkpoint,
    greedy,
    hf_reference,
    make_llm,
    rand_ids,
    rewrite_safetensors,
    tiny_checkpoint,
)

import nanovllm.model.loader as loader_mod  # noqa: E402
from nanovllm.model.families.qwen3 import Qwen3ForCausalLM  # noqa: E402
from nanovllm.model.dummy_weights import init_dummy  # noqa: E402
from nanovllm.model.loader import load_model  # noqa: E402

PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def hf_config(path):
    from transformers import Qwen3Config

    return Qwen3Config.from_pretrained(path)


def new_model(path) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(hf_config(path))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # anything not loaded shows up
    return model


def checkpoint_tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def expected_params(tensors: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """What each of our parameters must hold: packed q/k/v and gate/up concatenated."""
    out, packed = {}, {}
    for name, t in tensors.items():
        for part, (target, idx) in PACKED.items():
            if f".{part}." in name:
                packed.setdefault(name.replace(f".{part}.", f".{target}."), {})[idx] = t
                break
        else:
            out[name] = t
    for name, parts in packed.items():
        out[name] = torch.cat([parts[i] for i in sorted(parts)])
    if tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def assert_loaded(model, path, tied=False):
    expected = expected_params(checkpoint_tensors(path), tied)
    params = dict(model.named_parameters(remove_duplicate=False))
    assert set(params) == set(expected), set(params) ^ set(expected)
    for name, p in params.items():
        torch.testing.assert_close(p.data, expected[name].to(p.dtype), atol=0, rtol=0, msg=name)


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory, "gqa")


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory, "tied")


@pytest.mark.parametrize("name", ["gqa", "mqa", "tied", "odd_vocab", "wide_heads"])
def test_load_copies_every_tensor(tmp_path_factory, name):
    path = tiny_checkpoint(tmp_path_factory, name)
    model = new_model(path)
    load_model(model, path)
    assert_loaded(model, path, tied=name == "tied")


def test_loading_streams_one_tensor_at_a_time(gqa, monkeypatch):
    """Tensors are read one by one through safe_open and not kept: when a tensor is read, at most the
    previous one (still bound to a local variable) is alive. The whole-file loaders are not used."""
    real_safe_open = loader_mod.safe_open
    alive: list[weakref.ref] = []
    reads: list[str] = []
    peak = [0]

    class Handle:
        def __init__(self, f):
            self.f = f

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            peak[0] = max(peak[0], sum(r() is not None for r in alive))
            t = self.f.get_tensor(name)
            alive.append(weakref.ref(t))
            reads.append(name)
            return t

        def __getattr__(self, attr):
            return getattr(self.f, attr)

    class Opener:
        def __init__(self, *args, **kwargs):
            self.cm = real_safe_open(*args, **kwargs)

        def __enter__(self):
            return Handle(self.cm.__enter__())

        def __exit__(self, *exc):
            return self.cm.__exit__(*exc)

    def forbidden(*args, **kwargs):
        raise AssertionError("the loader must not read whole files")

    monkeypatch.setattr(loader_mod, "safe_open", Opener)
    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "load_file", forbidden)
    monkeypatch.setattr(safetensors.torch, "load", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    model = new_model(gqa)
    load_model(model, gqa)
    monkeypatch.undo()
    assert sorted(reads) == sorted(checkpoint_tensors(gqa)), "each tensor is read exactly once"
    assert peak[0] <= 1, f"{peak[0]} checkpoint tensors were alive at once"
    assert_loaded(model, gqa)


def test_sharded_checkpoint(gqa, tmp_path):
    from safetensors.torch import save_file

    folder = copy_checkpoint(gqa, tmp_path / "sharded")
    tensors = checkpoint_tensors(folder)
    os.remove(os.path.join(folder, "model.safetensors"))
    names = sorted(tensors)
    shards = [names[: len(names) // 2], names[len(names) // 2:]]
    index = {"metadata": {}, "weight_map": {}}
    for i, part in enumerate(shards):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, os.path.join(folder, file), metadata={"format": "pt"})
        index["weight_map"].update({n: file for n in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    model = new_model(folder)
    load_model(model, folder)
    assert_loaded(model, folder)


def _broken(src, tmp_path, fn):
    folder = copy_checkpoint(src, tmp_path / "broken")
    rewrite_safetensors(folder, fn)
    return folder


@pytest.mark.parametrize("name", ["model.norm.weight", "model.embed_tokens.weight", "lm_head.weight",
                                  "model.layers.0.self_attn.o_proj.weight", "model.layers.1.self_attn.q_norm.weight",
                                  "model.layers.1.self_attn.v_proj.weight", "model.layers.0.mlp.gate_proj.weight"])
def test_missing_tensor_is_named(gqa, tmp_path, name):
    def drop(t):
        del t[name]

    folder = _broken(gqa, tmp_path, drop)
    with pytest.raises(ValueError, match=re.escape(name)):
        load_model(new_model(folder), folder)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.extra.weight", "model.layers.2.mlp.up_proj.weight",
                                  "model.lm_head.weight", "score.weight"])
def test_unexpected_tensor_is_named(gqa, tmp_path, name):
    folder = _broken(gqa, tmp_path, lambda t: t.__setitem__(name, torch.zeros(8, 8)))
    with pytest.raises(ValueError, match=re.escape(name)):
        load_model(new_model(folder), folder)


@pytest.mark.parametrize("name,shape", [
    ("model.embed_tokens.weight", (516, 64)),
    ("model.embed_tokens.weight", (517, 32)),
    ("lm_head.weight", (518, 64)),
    ("model.layers.0.self_attn.q_proj.weight", (64, 64 + 1)),
    ("model.layers.0.self_attn.k_proj.weight", (64, 64)),  # k as big as q: 4 heads instead of 2
    ("model.layers.1.self_attn.v_proj.weight", (16, 64)),
    ("model.layers.0.self_attn.o_proj.weight", (64, 32)),
    ("model.layers.0.mlp.gate_proj.weight", (64, 64)),
    ("model.layers.1.mlp.up_proj.weight", (128, 32)),
    ("model.layers.1.mlp.down_proj.weight", (128, 64)),  # transposed
    ("model.layers.0.self_attn.k_norm.weight", (32,)),
    ("model.norm.weight", (64, 1)),
])
def test_wrong_shape_is_named(gqa, tmp_path, name, shape):
    folder = _broken(gqa, tmp_path, lambda t: t.__setitem__(name, torch.zeros(shape)))
    with pytest.raises(ValueError, match=re.escape(name)):
        load_model(new_model(folder), folder)


@pytest.mark.parametrize("keep", [5, 200, -1000])
def test_truncated_safetensors_file_is_named(gqa, tmp_path, keep):
    """A download cut short: the header too small, cut inside the header, or cut in the data.
    Before: safetensors' "Error while deserializing header: incomplete metadata..." without the
    file's name. Now a ValueError names the file, and LLM() raises it before any work."""
    folder = copy_checkpoint(gqa, tmp_path / "truncated")
    file = os.path.join(folder, "model.safetensors")
    with open(file, "rb") as f:
        data = f.read()
    with open(file, "wb") as f:
        f.write(data[:keep])
    with pytest.raises(ValueError, match=re.escape(file)):
        load_model(new_model(folder), folder)
    from nanovllm import LLM

    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(folder, kvcache_block_size=16, num_kvcache_blocks=8)


def test_no_safetensors_files(gqa, tmp_path):
    folder = copy_checkpoint(gqa, tmp_path / "none")
    tensors = checkpoint_tensors(folder)
    os.remove(os.path.join(folder, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(new_model(folder), folder)
    torch.save(tensors, os.path.join(folder, "pytorch_model.bin"))  # pickle checkpoints are never loaded
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(new_model(folder), folder)


def test_tied_embeddings_without_lm_head_in_the_file(tied):
    assert "lm_head.weight" not in checkpoint_tensors(tied)
    model = new_model(tied)
    load_model(model, tied)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert_loaded(model, tied, tied=True)


def test_tied_embeddings_with_lm_head_in_the_file(tied, tmp_path):
    def add_head(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    folder = _broken(tied, tmp_path, add_head)
    model = new_model(folder)
    load_model(model, folder)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    expected = checkpoint_tensors(tied)
    assert_loaded(model, tied, tied=True)
    torch.testing.assert_close(model.lm_head.weight.data, expected["model.embed_tokens.weight"], atol=0, rtol=0)
    # And the engine on it generates what transformers does.
    llm = make_llm(folder)
    prompt = rand_ids(20, 5)
    out = llm.generate([prompt], greedy(8), use_tqdm=False)[0]
    assert out["token_ids"] == hf_reference(tied, prompt, 8)


def test_untied_model_needs_its_lm_head(gqa, tmp_path):
    def drop(t):
        del t["lm_head.weight"]

    folder = _broken(gqa, tmp_path, drop)
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        load_model(new_model(folder), folder)


def test_rotary_inv_freq_in_old_checkpoints_is_ignored(gqa, tmp_path):
    def add(t):
        for i in range(2):
            t[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    folder = _broken(gqa, tmp_path, add)
    model = new_model(folder)
    load_model(model, folder)
    assert_loaded(model, gqa)


def test_bfloat16_checkpoint_into_a_float32_model(tmp_path_factory):
    path = tiny_checkpoint(tmp_path_factory, "gqa", dtype=torch.bfloat16, with_tokenizer=False)
    assert all(t.dtype == torch.bfloat16 for t in checkpoint_tensors(path).values())
    model = new_model(path)
    load_model(model, path)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert_loaded(model, path)


def test_dummy_weights(gqa):
    model = new_model(gqa)
    init_dummy(model, seed=0)
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        if "norm" in name:
            assert torch.all(p == 1), name
        else:
            assert 0.005 < p.float().std().item() < 0.1, name
    again = new_model(gqa)
    init_dummy(again, seed=0)
    other = new_model(gqa)
    init_dummy(other, seed=1)
    for (name, a), b, c in zip(model.named_parameters(), again.parameters(), other.parameters()):
        assert torch.equal(a, b), name
        if "norm" not in name:
            assert not torch.equal(a, c), name


def test_dummy_load_format_needs_no_safetensors(gqa, tmp_path):
    folder = tmp_path / "config_only"
    folder.mkdir()
    for f in ("config.json", "generation_config.json"):
        with open(os.path.join(gqa, f)) as src, open(folder / f, "w") as dst:
            dst.write(src.read())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        make_llm(str(folder), skip_tokenizer_init=True)
    llm = make_llm(str(folder), load_format="dummy", skip_tokenizer_init=True)
    outputs = llm.generate([rand_ids(17, 1), [3]], greedy(6), use_tqdm=False)
    assert [len(o["token_ids"]) for o in outputs] == [6, 6]
    assert [o["finish_reason"] for o in outputs] == ["length", "length"]
    # Deterministic for a given seed.
    again = make_llm(str(folder), load_format="dummy", skip_tokenizer_init=True)
    assert again.generate([rand_ids(17, 1), [3]], greedy(6), use_tqdm=False) == outputs
