"""`SamplingParams(n > 1)` end to end (CPU, float32, tiny model): one prefill of the prompt, n
samples on its shared KV blocks (full blocks by ref count, the partly filled last block copied
on write), seeded samples reproducible and equal to n = 1 requests with the derived seeds, and
no block leaked — also with chunked prefill (the prompt's last token in a decode row),
preemption, aborts and streaming.

Exactness: with prefix caching off every sample's K/V is the arithmetic an n = 1 request of the
same prompt does (identical float32 operations on identical values), so tokens must be equal,
not close. The scheduler-level fuzzer (test_scheduler.py) checks the block bookkeeping itself.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers import BLOCK, assert_idle, greedy, hf_reference, make_llm, rand_ids  # noqa: E402

from nanovllm import SamplingParams  # noqa: E402
from nanovllm.sampling_params import derive_sample_seed  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def exact(ckpt):
    """No prefix cache: every request computes its own prompt, so n = 1 runs are exact references."""
    return make_llm(ckpt, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def cached(ckpt):
    return make_llm(ckpt)


def sampled(n=1, seed=7, max_tokens=12, **kw):
    return SamplingParams(n=n, seed=seed, temperature=0.9, max_tokens=max_tokens, ignore_eos=True, **kw)


def run_counting_prefill(llm, prompts, params):
    """(outputs, prompt tokens computed by prefill steps): StepTiming of every resolved step."""
    seen = []

    def observe(timing):
        if timing.is_prefill:
            seen.append(timing.num_tokens)

    llm.step_observers.append(observe)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.step_observers.remove(observe)
    return outs, sum(seen)


def completions(out):
    return [c.token_ids for c in out.outputs]


@pytest.mark.parametrize("length", [2 * BLOCK + 5, 2 * BLOCK], ids=["partial_last_block", "full_blocks"])
def test_n_samples_prefill_the_prompt_once_and_equal_n1_with_derived_seeds(exact, length):
    prompt = rand_ids(length, 500 + length)
    out, prefilled = run_counting_prefill(exact, [prompt], sampled(n=4))
    out = out[0]
    assert prefilled == length, f"{prefilled} prompt tokens prefilled for n=4, the prompt has {length}"
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(t) for t in completions(out)}) >= 3, "the samples did not draw from different streams"
    assert out["token_ids"] == out.outputs[0].token_ids  # dict access reads the first completion
    # Sample i is the n = 1 request with seed derive_sample_seed(7, i) (sample 0: seed 7 itself).
    singles = exact.generate([prompt] * 4, [sampled(seed=derive_sample_seed(7, i)) for i in range(4)], use_tqdm=False)
    assert completions(out) == [s["token_ids"] for s in singles]
    assert [c.text for c in out.outputs] == [s["text"] for s in singles]
    # Reproducible.
    again = exact.generate([prompt], sampled(n=4), use_tqdm=False)[0]
    assert completions(again) == completions(out)
    assert_idle(exact)


def test_greedy_samples_all_read_the_same_prompt_kv(ckpt, exact):
    """Greedy samples must all be transformers' greedy continuation: a fork reading a wrong or
    uncopied block would diverge. Prompts with and without a partly filled last block, and a
    prompt whose last token is computed as a decode row (a 16-token chunk leaves one token)."""
    prompts = [rand_ids(37, 510), rand_ids(32, 511), rand_ids(17, 512), rand_ids(1, 513)]
    chunked = make_llm(ckpt, enable_prefix_caching=False, max_num_batched_tokens=16)
    for llm in (exact, chunked):
        outs = llm.generate(prompts, SamplingParams(n=3, temperature=0.0, max_tokens=20, ignore_eos=True),
                            use_tqdm=False)
        for p, out in zip(prompts, outs):
            ref = hf_reference(ckpt, p, 20)
            assert completions(out) == [ref] * 3
        assert_idle(llm)


def test_prefix_hits_and_n_samples(cached):
    """With the prefix cache on: the second run of the same n = 4 request computes only what the
    cache lacks, gives the same samples, and reports its hits."""
    prompt = rand_ids(3 * BLOCK + 3, 520)
    first, pre1 = run_counting_prefill(cached, [prompt], sampled(n=4, seed=11))
    second, pre2 = run_counting_prefill(cached, [prompt], sampled(n=4, seed=11))
    assert pre1 == len(prompt) and pre2 == len(prompt) - 3 * BLOCK
    assert first[0].num_cached_tokens == 0 and second[0].num_cached_tokens == 3 * BLOCK
    assert completions(second[0]) == completions(first[0])
    assert_idle(cached)


def test_mixed_batch_of_n_and_single_requests(exact):
    """n > 1 requests next to n = 1 ones (greedy and seeded): nobody's tokens change."""
    prompts = [rand_ids(20, 530), rand_ids(9, 531), rand_ids(40, 532)]
    params = [sampled(n=3, seed=5), greedy(15), sampled(n=2, seed=6, max_tokens=7)]
    outs = exact.generate(prompts, params, use_tqdm=False)
    alone = [exact.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    assert [completions(o) for o in outs] == [completions(o) for o in alone]
    assert [len(o.outputs) for o in outs] == [3, 1, 2]
    assert_idle(exact)


def test_n_samples_under_preemption(ckpt, exact):
    """A KV cache of 8 blocks for 2 requests of 4 samples that grow to 4 blocks each: samples
    are preempted and recomputed on their own; the tokens are those of an unconstrained run and
    every block comes back."""
    prompts = [rand_ids(20, 540), rand_ids(25, 541)]
    params = [sampled(n=4, seed=21, max_tokens=40), sampled(n=4, seed=22, max_tokens=30)]
    want = [completions(o) for o in exact.generate(prompts, params, use_tqdm=False)]
    for options in (dict(), dict(enable_prefix_caching=False)):
        tight = make_llm(ckpt, num_kvcache_blocks=8, **options)
        outs = tight.generate(prompts, params, use_tqdm=False)
        assert tight.scheduler.num_preemptions > 0, "the test meant to force preemption but none happened"
        assert [completions(o) for o in outs] == want
        assert_idle(tight)


def test_n_samples_stream_and_early_close(exact):
    prompt = rand_ids(21, 550)
    params = sampled(n=3, seed=31, max_tokens=9)
    want = exact.generate([prompt], params, use_tqdm=False)[0]
    incs = list(exact.stream([prompt], params))
    for i in range(3):
        mine = [inc for inc in incs if inc.sample == i]
        assert [t for inc in mine for t in inc.token_ids] == want.outputs[i].token_ids
        assert "".join(inc.text for inc in mine) == want.outputs[i].text
        assert mine[-1].finish_reason == "length" and all(inc.finish_reason is None for inc in mine[:-1])
    # One increment, the request's last, says the request is finished.
    assert [inc.finished for inc in incs] == [False] * (len(incs) - 1) + [True]
    assert {inc.index for inc in incs} == {0}
    # Closing the stream early aborts every sample and frees every block.
    it = exact.stream([prompt, rand_ids(5, 551)], [params, sampled(n=2)])
    next(it)
    next(it)
    it.close()
    assert_idle(exact)
    assert completions(exact.generate([prompt], params, use_tqdm=False)[0]) == completions(want)


def test_stop_conditions_per_sample(exact):
    """Each sample ends on its own: a stop token id taken from sample 1's own run ends sample 1
    there (stop_reason = the id) while the others that never sample it run to max_tokens."""
    prompt = rand_ids(12, 560)
    base = exact.generate([prompt], sampled(n=3, seed=41, max_tokens=10), use_tqdm=False)[0]
    toks = base.outputs[1].token_ids
    k, stop = next((k, t) for k, t in enumerate(toks) if k >= 2 and t not in toks[:k])
    out = exact.generate([prompt], sampled(n=3, seed=41, max_tokens=10, stop_token_ids=[stop]), use_tqdm=False)[0]
    assert out.outputs[1].token_ids == toks[:k + 1]
    assert out.outputs[1].finish_reason == "stop" and out.outputs[1].stop_reason == stop
    for i in (0, 2):
        ref = base.outputs[i].token_ids
        end = ref.index(stop) + 1 if stop in ref else len(ref)
        assert out.outputs[i].token_ids == ref[:end]
    assert_idle(exact)


@pytest.mark.parametrize("bad", [dict(n=0), dict(n=-1), dict(n=1.5), dict(n=True)])
def test_bad_n_is_a_value_error(bad):
    with pytest.raises(ValueError, match=r"\bn\b"):
        SamplingParams(**bad)


def test_n_larger_than_max_num_seqs_or_the_cache_raises_before_any_work(ckpt):
    llm = make_llm(ckpt, max_num_seqs=4, num_kvcache_blocks=5)
    launches = []
    real = llm.model_runner.launch
    llm.model_runner.launch = lambda *a, **k: launches.append(1) or real(*a, **k)
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.generate([rand_ids(5, 570)], sampled(n=5), use_tqdm=False)
    # 3 prompt blocks + a copy of the partial last block for each of 3 more samples > 5 blocks.
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate([rand_ids(2 * BLOCK + 1, 571)], sampled(n=4, max_tokens=2), use_tqdm=False)
    assert not launches
    out = llm.generate([rand_ids(2 * BLOCK + 1, 571)], sampled(n=2, max_tokens=2), use_tqdm=False)[0]
    assert len(out.outputs) == 2
    assert_idle(llm)


_FEATURE_LOADS = """
import json, sys
from nanovllm import LLM, SamplingParams

MODULES = {"n": "nanovllm.features.parallel_sampling", "prompt_logprobs": "nanovllm.features.prompt_logprobs",
           "mixed": "nanovllm.features.mixed_steps"}
seen = {}
def snapshot(name, llm):
    seen[name] = {"loaded": sorted(k for k, m in MODULES.items() if m in sys.modules),
                  "hooks": [type(h).__name__ for h in llm.scheduler.hooks],
                  "policy": type(llm.scheduler.policy).__name__}
llm = LLM(sys.argv[1], kvcache_block_size=16, num_kvcache_blocks=64)
llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
snapshot("greedy", llm)
for _ in range(2):  # registered once
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, n=2), use_tqdm=False)
snapshot("n", llm)
llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1), use_tqdm=False)
snapshot("prompt_logprobs", llm)
snapshot("mixed", LLM(sys.argv[1], kvcache_block_size=16, num_kvcache_blocks=64, mixed_steps=True))
print(json.dumps(seen))
"""


def test_scheduling_features_load_only_when_asked_for(ckpt):
    """A plain greedy generate loads none of the scheduling features; n > 1 and prompt logprobs
    register their hooks on the first request that asks (once), mixed steps with the option."""
    import json
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", _FEATURE_LOADS, ckpt], capture_output=True, text=True,
                          timeout=600, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["greedy"] == {"loaded": [], "hooks": [], "policy": "NoneType"}
    assert seen["n"] == {"loaded": ["n"], "hooks": ["ParallelSampling"], "policy": "NoneType"}
    assert seen["prompt_logprobs"]["loaded"] == ["n", "prompt_logprobs"]
    assert seen["prompt_logprobs"]["hooks"] == ["ParallelSampling", "PromptLogprobs"]
    assert seen["mixed"]["loaded"] == ["mixed", "n", "prompt_logprobs"] and seen["mixed"]["policy"] == "MixedSteps"
    assert seen["mixed"]["hooks"] == []
