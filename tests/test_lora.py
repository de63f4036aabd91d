"""LoRA adapters served per request (features/lora/), on CPU in float32, against PEFT on tiny
random Qwen3 / Llama checkpoints: greedy tokens with an adapter equal PEFT's model; a batch
mixing two adapters and the base equals each run alone; the prefix cache never serves one
adapter's K/V to another; a slot shortage (max_loras=1) queues requests and evicts the least
recently used adapter without changing results; tensor parallelism; clear errors."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import tiny_model as tm  # noqa: E402
from helpers import greedy, make_llm, rand_ids  # noqa: E402

peft = pytest.importorskip("peft")

from nanovllm import SamplingParams  # noqa: E402
from nanovllm.lora.request import LoRARequest  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [rand_ids(9, 1), rand_ids(21, 2), rand_ids(5, 3)]


def adapter(base: str, folder, r: int, alpha: int, seed: int, targets=TARGETS, **extra):
    """A PEFT adapter of `base` with large random B (so it changes greedy tokens), saved in
    `folder`; returns PEFT's model of it."""
    torch.manual_seed(seed)
    pm = peft.get_peft_model(tm.load_hf_model(base), peft.LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **extra))
    for name, p in pm.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0.0, 0.5)
    pm.save_pretrained(str(folder))
    return pm


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    base = tm.make_tiny_qwen3(d / "base", num_layers=2, seed=21)
    pm1 = adapter(base, d / "a1", 4, 16, seed=1)
    pm2 = adapter(base, d / "a2", 8, 8, seed=2, targets=["q_proj", "v_proj", "down_proj"], use_rslora=True)
    reqs = [LoRARequest("a1", 1, str(d / "a1")), LoRARequest("a2", 2, str(d / "a2"))]
    want = {name: [tm.hf_greedy(m, p, 10) for p in PROMPTS] for name, m in (("a1", pm1), ("a2", pm2))}
    want["base"] = [tm.hf_greedy(tm.load_hf_model(base), p, 10) for p in PROMPTS]
    return base, reqs, want


def tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def test_each_adapter_and_a_mixed_batch_equal_peft(setup):
    base, (r1, r2), want = setup
    with make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        assert tokens(llm.generate(PROMPTS, greedy(10), use_tqdm=False, lora_request=r1)) == want["a1"]
        assert tokens(llm.generate(PROMPTS, greedy(10), use_tqdm=False, lora_request=r2)) == want["a2"]
        assert tokens(llm.generate(PROMPTS, greedy(10), use_tqdm=False)) == want["base"]
        assert want["a1"] != want["base"] != want["a2"]
        # One batch: prompt 0 under a1, 1 under a2, 2 under none.
        mixed = tokens(llm.generate(PROMPTS, greedy(10), use_tqdm=False, lora_request=[r1, r2, None]))
        assert mixed == [want["a1"][0], want["a2"][1], want["base"][2]]
        chat = llm.chat([{"role": "user", "content": "hi"}], greedy(4), use_tqdm=False, lora_request=r1)
        assert len(chat[0].outputs[0].token_ids) == 4


def test_the_prefix_cache_is_kept_per_adapter(setup):
    base, (r1, r2), want = setup
    long = rand_ids(64, 9)
    with make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        first = tokens(llm.generate([long], greedy(6), use_tqdm=False, lora_request=r1))
        bm = llm.block_manager
        hits = bm.num_prefix_hit_tokens
        other = tokens(llm.generate([long], greedy(6), use_tqdm=False, lora_request=r2))
        assert bm.num_prefix_hit_tokens == hits  # nothing of a1's blocks served to a2
        assert tokens(llm.generate([long], greedy(6), use_tqdm=False, lora_request=r1)) == first
        assert bm.num_prefix_hit_tokens > hits  # a1 hits its own blocks
    with make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8, enable_prefix_caching=False) as fresh:
        assert tokens(fresh.generate([long], greedy(6), use_tqdm=False, lora_request=r2)) == other


def test_one_slot_queues_requests_and_evicts_the_least_recent(setup):
    base, (r1, r2), want = setup
    with make_llm(base, enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=1) as llm:
        got = tokens(llm.generate(PROMPTS + PROMPTS, greedy(10), use_tqdm=False,
                                  lora_request=[r1, r2, r1, r2, None, r2]))
        assert got == [want["a1"][0], want["a2"][1], want["a1"][2], want["a2"][0], want["base"][1], want["a2"][2]]


def test_n_samples_and_tensor_parallelism(setup):
    base, (r1, r2), want = setup
    with make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8, tensor_parallel_size=2) as llm:
        assert tokens(llm.generate(PROMPTS, greedy(10), use_tqdm=False, lora_request=[r1, r2, r1])) == \
            [want["a1"][0], want["a2"][1], want["a1"][2]]
        two = llm.generate([PROMPTS[0]], SamplingParams(n=2, temperature=0, max_tokens=10), use_tqdm=False,
                           lora_request=r1)
        assert [list(c.token_ids) for c in two[0].outputs] == [want["a1"][0]] * 2


def test_bad_adapters_and_options_are_refused_before_any_work(setup, tmp_path):
    base, (r1, r2), want = setup
    with make_llm(base) as plain:
        with pytest.raises(ValueError, match="enable_lora=True"):
            plain.generate(PROMPTS, greedy(2), use_tqdm=False, lora_request=r1)
    with make_llm(base, enable_lora=True, max_loras=1, max_lora_rank=4) as llm:
        with pytest.raises(ValueError, match="max_lora_rank=4"):
            llm.generate(PROMPTS, greedy(2), use_tqdm=False, lora_request=r2)
        with pytest.raises(FileNotFoundError, match="no folder"):
            llm.generate(PROMPTS, greedy(2), use_tqdm=False, lora_request=LoRARequest("x", 7, str(tmp_path / "no")))
        with pytest.raises(ValueError, match="3 prompts"):
            llm.generate(PROMPTS, greedy(2), use_tqdm=False, lora_request=[r1])
        with pytest.raises(ValueError, match="lora_int_id"):
            llm.generate(PROMPTS, greedy(2), use_tqdm=False, lora_request=LoRARequest("a1", 0, r1.lora_path))
        assert tokens(llm.generate(PROMPTS, greedy(10), use_tqdm=False, lora_request=r1)) == want["a1"]
    with pytest.raises(ValueError, match="max_loras"):
        make_llm(base, enable_lora=True, max_loras=0)


def test_a_llama_adapter_equals_peft(tmp_path):
    base = tm.make_tiny_model(tmp_path / "llama", "llama", num_layers=2, seed=23)
    pm = adapter(base, tmp_path / "a", 8, 16, seed=4)
    want = [tm.hf_greedy(pm, p, 10) for p in PROMPTS]
    with make_llm(base, enable_lora=True, max_lora_rank=8) as llm:
        got = tokens(llm.generate(PROMPTS, greedy(10), use_tqdm=False, lora_request=LoRARequest("a", 3, str(tmp_path / "a"))))
    assert got == want


@pytest.mark.gpu
def test_adapters_inside_cuda_graphs(setup, tmp_path):
    """On CUDA (bf16): decode graphs replay the per-token updates with the slots of each step;
    the tokens equal the eager engine's, alone and in a batch mixing both adapters and the base."""
    base, (r1, r2), _ = setup
    kw = dict(enable_lora=True, max_loras=2, max_lora_rank=8, dtype="bfloat16", num_kvcache_blocks=256)
    requests = (r1, r2, [r1, r2, None], None)
    with make_llm(base, enforce_eager=True, **kw) as eager:
        want = [tokens(eager.generate(PROMPTS, greedy(12), use_tqdm=False, lora_request=r)) for r in requests]
    with make_llm(base, **kw) as graphs:
        assert graphs.model_runner.graphs is not None
        got = [tokens(graphs.generate(PROMPTS, greedy(12), use_tqdm=False, lora_request=r)) for r in requests]
    assert got == want
    assert want[2] == [want[0][0], want[1][1], want[3][2]]


@pytest.mark.gpu
def test_the_cuda_kernels_in_float32_equal_peft(setup):
    """On CUDA in float32 (the shrink / expand kernels multiply in full fp32): a batch mixing both
    adapters and the base gives PEFT's greedy tokens, through prefill and decode graphs."""
    base, (r1, r2), want = setup
    with make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32",
                  num_kvcache_blocks=256) as llm:
        assert llm.model_runner.device.type == "cuda"
        got = tokens(llm.generate(PROMPTS, greedy(10), use_tqdm=False, lora_request=[r1, r2, None]))
    assert got == [want["a1"][0], want["a2"][1], want["base"][2]]
