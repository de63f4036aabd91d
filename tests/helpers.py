"""Shared helpers for the engine-level tests (test_llm.py, test_loader.py, test_config.py).

Checkpoints are tiny random models from `tiny_model.py`, created once per test session and
shared between modules (`tiny_checkpoint`); transformers reference runs are cached too
(`hf_reference`), so every expensive thing happens once.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

import tiny_model as tm  # noqa: E402

BLOCK = 16  # kvcache_block_size used by every engine in these tests
BPE_VOCAB = 512  # ids below this are ordinary (non-special) tokens of the tiny tokenizer
EOS_IDS = (tm.special_token_ids()["<|im_end|>"], tm.special_token_ids()["<|endoftext|>"])

_CHECKPOINTS: dict[tuple, str] = {}
_HF_MODELS: dict[str, object] = {}
_HF_GREEDY: dict[tuple, list[int]] = {}


def tiny_checkpoint(tmp_path_factory, name: str = "gqa", **overrides) -> str:
    """Path of a tiny checkpoint made from `tm.CONFIGS[name]` (Qwen3) or `tm.MODEL_CONFIGS[name]`
    (the other families), + overrides, created once per session."""
    key = (name, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
    if key not in _CHECKPOINTS:
        _CHECKPOINTS[key] = tm.make_named(tmp_path_factory.mktemp(f"ckpt_{name}"), name, **overrides)
    return _CHECKPOINTS[key]


def copy_checkpoint(src: str, dst) -> str:
    """A private copy of a checkpoint folder, to break or edit."""
    shutil.copytree(src, dst)
    return str(dst)


def edit_json(path: str, fn) -> None:
    """Rewrite a JSON file in place with `fn(dict)` (which edits the dict or returns a new one)."""
    with open(path) as f:
        data = json.load(f)
    new = fn(data)
    with open(path, "w") as f:
        json.dump(data if new is None else new, f, indent=2)


rewrite_safetensors = tm.rewrite_tensors  # (the name the test modules use)


def rand_ids(n: int, seed: int, high: int = BPE_VOCAB) -> list[int]:
    """`n` deterministic pseudo-random ordinary token ids."""
    rng = random.Random(seed)
    return [rng.randrange(high) for _ in range(n)]


def greedy(max_tokens: int, **kw):
    from nanovllm import SamplingParams

    kw.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def make_llm(path: str, **kw):
    """An `LLM` on CPU with the tests' defaults (block size 16, a small KV cache)."""
    from nanovllm import LLM

    kw.setdefault("kvcache_block_size", BLOCK)
    kw.setdefault("num_kvcache_blocks", 128)
    return LLM(path, **kw)


def hf_model(path: str):
    if path not in _HF_MODELS:
        _HF_MODELS[path] = tm.load_hf_model(path)
    return _HF_MODELS[path]


def hf_reference(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation (EOS ignored) of `prompt_ids`, cached."""
    key = (path, tuple(prompt_ids), max_new_tokens)
    if key not in _HF_GREEDY:
        _HF_GREEDY[key] = tm.hf_greedy(hf_model(path), list(prompt_ids), max_new_tokens)
    return _HF_GREEDY[key]


@torch.inference_mode()
def hf_logits(path: str, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits [len(ids), vocab] for every position of `ids`."""
    return hf_model(path)(torch.tensor([list(ids)])).logits[0].float()


def assert_idle(llm) -> None:
    """No request is queued or running and every KV block is free (or merely cached)."""
    assert not llm.scheduler.waiting, f"requests left waiting: {list(llm.scheduler.waiting)}"
    assert not llm.scheduler.running, f"requests left running: {list(llm.scheduler.running)}"
    assert not llm.has_unfinished()
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} KV blocks still held"


def reference_moe(hidden, w13, w2, weights, ids) -> torch.Tensor:
    """The MoE layer's output token by token, expert by expert, in float64 on the CPU (hidden
    [T, H], w13 [E, 2I, H] gate rows then up rows, w2 [E, H, I], weights / ids [T, k])."""
    hidden, w13, w2, weights, ids = (t.cpu() for t in (hidden, w13, w2, weights, ids))
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        x = hidden[t].double()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e].double() @ x).chunk(2)
            out[t] += float(weights[t, j]) * (w2[e].double() @ (torch.nn.functional.silu(gate) * up))
    return out
