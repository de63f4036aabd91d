"""vLLM's offline examples, written as users write them with only the import line changed (and
the model a tiny one, on the CPU): prompt dicts with TokensPrompt, logprobs, prefix caching and
beam search (the quick start, default sampling, chat, llm_engine_example and metrics examples are
in test_vllm_api / _chat / _engine_api / _metrics)."""

from __future__ import annotations

import contextlib
import io
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TOKENS_PROMPT = '''
from nanovllm import LLM, SamplingParams
from nanovllm.inputs import TokensPrompt

llm = LLM(model=MODEL, **CPU)
tokenizer = llm.get_tokenizer()
prompt_token_ids = tokenizer.encode("Hello, my name is")
outputs = llm.generate(TokensPrompt(prompt_token_ids=prompt_token_ids), SamplingParams(temperature=0, max_tokens=8))
print(outputs[0].prompt_token_ids == prompt_token_ids, len(outputs[0].outputs[0].token_ids))
'''

LOGPROBS = '''
from nanovllm import LLM, SamplingParams

llm = LLM(model=MODEL, **CPU)
sampling_params = SamplingParams(temperature=0.8, max_tokens=4, logprobs=5, prompt_logprobs=5)
outputs = llm.generate(["The capital of France is"], sampling_params)
for output in outputs:
    print(len(output.outputs[0].logprobs), output.prompt_logprobs[0],
          all(5 <= len(entry) <= 6 for entry in output.outputs[0].logprobs))
'''

# vLLM's examples/offline_inference/prefix_caching.py (its cleanup_dist_env_and_memory import aside).
PREFIX_CACHING = '''
from nanovllm import LLM, SamplingParams

prefix = ("You are an expert school principal, skilled in effectively managing faculty and staff. "
          "Draft 10-15 questions for a potential first grade Head Teacher for my K-12, all-girls', "
          "independent school that emphasizes community, joy in learning, and education of the whole child.")
prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is",
           "The future of AI is"]
generating_prompts = [prefix + prompt for prompt in prompts]
sampling_params = SamplingParams(temperature=0.0, max_tokens=8)

regular_llm = LLM(model=MODEL, gpu_memory_utilization=0.4, enable_prefix_caching=False, **CPU)
regular_generated_outputs = regular_llm.generate(generating_prompts, sampling_params)
regular_generated_texts = [output.outputs[0].text for output in regular_generated_outputs]
del regular_llm

prefix_cached_llm = LLM(model=MODEL, enable_prefix_caching=True, gpu_memory_utilization=0.4, **CPU)
prefix_cached_llm.generate(generating_prompts[0], sampling_params)
outputs = prefix_cached_llm.generate(generating_prompts, sampling_params)
cached_generated_texts = [output.outputs[0].text for output in outputs]
generated_same = all(regular_generated_texts[i] == cached_generated_texts[i] for i in range(len(prompts)))
print(f"Generated answers are the same: {generated_same}")
print(f"Cached prompt tokens: {min(output.num_cached_tokens for output in outputs)}")
'''

BEAM_SEARCH = '''
from nanovllm import LLM
from nanovllm.sampling_params import BeamSearchParams

llm = LLM(model=MODEL, **CPU)
params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
outputs = llm.beam_search([{"prompt": "Hello, my name is"}, {"prompt": "The capital of France is"}], params)
for output in outputs:
    for sequence in output.sequences:
        print(len(sequence.tokens), round(sequence.cum_logprob, 3) <= 0, isinstance(sequence.text, str))
'''


def run(script: str, ckpt: str) -> list[str]:
    out = io.StringIO()
    cpu = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=64)
    with contextlib.redirect_stdout(out):
        exec(compile(script, "<vllm example>", "exec"), {"__name__": "__main__", "MODEL": ckpt, "CPU": cpu})
    return out.getvalue().strip().splitlines()


def test_tokens_prompt_example(ckpt):
    assert run(TOKENS_PROMPT, ckpt) == ["True 8"]


def test_logprobs_example(ckpt):
    assert run(LOGPROBS, ckpt) == ["4 None True"]


def test_prefix_caching_example(ckpt):
    lines = run(PREFIX_CACHING, ckpt)
    assert lines[0] == "Generated answers are the same: True"
    assert int(lines[1].split(": ")[1]) >= 16  # at least one full block of the shared prefix was served from the cache


def test_beam_search_example(ckpt, llm):
    lines = run(BEAM_SEARCH, ckpt)
    lengths = [len(llm.tokenize(p)) + 6 for p in ("Hello, my name is", "The capital of France is")]
    assert lines == [f"{n} True True" for n in lengths for _ in range(3)]
