"""vLLM's import paths and LLM() keywords (drop-in round 2): the classes vLLM scripts import
exist where vLLM has them, work where nano-vllm has the feature and name what it lacks; vLLM's
engine keywords are read with their meaning or refused with the reason, before any work."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from helpers import assert_idle, greedy, make_llm  # noqa: E402

from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.config import Config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_prompt_types_from_nanovllm_inputs(llm):
    from nanovllm.inputs import TextPrompt, TokensPrompt

    ids = llm.tokenize("Hello, world!")
    by_ids = llm.generate([TokensPrompt(prompt_token_ids=ids)], greedy(4), use_tqdm=False)[0]
    by_text = llm.generate([TextPrompt(prompt="Hello, world!")], greedy(4), use_tqdm=False)[0]
    assert by_ids.prompt_token_ids == ids == by_text.prompt_token_ids
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids and by_text.prompt == "Hello, world!"


def test_request_output_kind_beam_search_and_structured_outputs_import_where_vllm_has_them(llm):
    from nanovllm.sampling_params import BeamSearchParams, RequestOutputKind, StructuredOutputsParams

    final = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0, output_kind=RequestOutputKind.FINAL_ONLY),
                         use_tqdm=False)[0]
    cumulative = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0,
                                                        output_kind=RequestOutputKind.CUMULATIVE), use_tqdm=False)[0]
    assert final.outputs[0].token_ids == cumulative.outputs[0].token_ids and len(final.outputs[0].token_ids) == 3
    assert SamplingParams(output_kind=RequestOutputKind.DELTA).output_kind is RequestOutputKind.DELTA  # (step API)
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")
    if importlib.util.find_spec("xgrammar"):  # (tests/test_structured_outputs.py)
        choice = llm.generate(["Hello"], SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
                              use_tqdm=False)[0]
        assert choice.outputs[0].text in ("yes", "no")
    out = llm.beam_search(["Hello"], BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))  # (test_beam_search)
    assert len(out[0].sequences) == 2
    assert_idle(llm)


def test_vllms_block_size_is_the_kv_block_size(ckpt):
    assert Config.from_kwargs(ckpt, block_size=32).kvcache_block_size == 32
    assert Config.from_kwargs(ckpt, block_size=32, kvcache_block_size=32).kvcache_block_size == 32
    with pytest.raises(ValueError, match="block_size=32 .* kvcache_block_size=64 disagree"):
        Config.from_kwargs(ckpt, block_size=32, kvcache_block_size=64)
    with pytest.raises(ValueError, match="kvcache_block_size"):
        Config.from_kwargs(ckpt, block_size=24)


@pytest.mark.parametrize("name, accepted, refused, why", [
    ("enable_chunked_prefill", [True, None], [False], "always splits a long prompt"),
    ("swap_space", [0, None], [4, 16], "preempts a request by recompute"),
    ("compilation_config", [None, {}, 0], [3, {"level": 3}], "does not use torch.compile"),
])
def test_vllm_only_keywords_are_read_or_refused_with_the_reason(ckpt, name, accepted, refused, why):
    for value in accepted:
        Config.from_kwargs(ckpt, **{name: value})
    for value in refused:
        with pytest.raises(NotImplementedError, match=f"{name}=.*{why}"):
            LLM(ckpt, device="cpu", **{name: value})


def test_disable_log_stats_download_dir_and_bad_values(ckpt, tmp_path):
    cfg = Config.from_kwargs(ckpt, disable_log_stats=False, download_dir=str(tmp_path))
    assert cfg.disable_log_stats is False and cfg.download_dir == str(tmp_path)
    with pytest.raises(ValueError, match="disable_log_stats"):
        Config.from_kwargs(ckpt, disable_log_stats="no")
    with pytest.raises(ValueError, match="download_dir"):
        Config.from_kwargs(ckpt, download_dir=3)
    with pytest.raises(ValueError, match="hf_overrides"):
        Config.from_kwargs(ckpt, hf_overrides=["rope_theta", 1.0])
    with pytest.raises(NotImplementedError, match="hf_overrides as a function"):
        Config.from_kwargs(ckpt, hf_overrides=lambda c: c)


def test_hf_overrides_replace_config_entries_before_the_model_is_built(ckpt):
    base = make_llm(ckpt)
    rope = dict(base.config.hf_config.rope_parameters)
    llm = make_llm(ckpt, hf_overrides={"max_position_embeddings": 96, "rope_parameters": {"rope_theta": 5000.0}})
    hf = llm.config.hf_config
    assert hf.max_position_embeddings == 96 and llm.config.max_model_len == 96
    assert hf.rope_parameters == {**rope, "rope_theta": 5000.0}  # a nested dict: merged, not replaced
    assert rope["rope_theta"] != 5000.0
    # The engine runs on the overridden config: another RoPE base, other logits.
    a = base.generate(["Hello, world!"], SamplingParams(max_tokens=1, temperature=0, logprobs=3), use_tqdm=False)
    b = llm.generate(["Hello, world!"], SamplingParams(max_tokens=1, temperature=0, logprobs=3), use_tqdm=False)
    assert a[0].outputs[0].logprobs != b[0].outputs[0].logprobs
    base.shutdown()
    llm.shutdown()


def test_engine_args_check_at_construction(ckpt):
    from nanovllm.engine_args import EngineArgs

    args = EngineArgs(model=ckpt, max_num_seqs=4, block_size=16)
    assert args.model == ckpt and args.max_num_seqs == 4 and args.kwargs == {"max_num_seqs": 4, "block_size": 16}
    with pytest.raises(TypeError, match="max_num_seq"):
        EngineArgs(model=ckpt, max_num_seq=4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineArgs(model=ckpt, max_num_seqs=0)


def test_max_tokens_none_generates_up_to_max_model_len(ckpt):
    """vLLM's max_tokens=None: up to max_model_len (here also within the KV cache), per prompt."""
    llm = make_llm(ckpt, max_model_len=48)
    prompts = [[5] * 10, [7] * 30]
    sp = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [38, 18]
    assert all(o.outputs[0].finish_reason == "length" for o in outs) and sp.max_tokens is None
    streamed = [s for s in llm.stream([prompts[1]], sp)]
    assert sum(len(s.token_ids) for s in streamed) == 18
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=5).max_tokens is None
    assert_idle(llm)
    llm.shutdown()
