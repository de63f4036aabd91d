"""`logprobs` and `prompt_logprobs` (CPU, float32, tiny model) against transformers.

Every value is log_softmax of transformers' float32 logits of the same sequence: the model's raw
distribution (vLLM V1's default), whatever the request's temperature, penalties or filters.
Bound: |ours - reference| <= 1e-4. The engine's logits match transformers' to well under 1e-5 on
this model (2 layers, width 64, float32; test_llm checks 1e-4), and log_softmax moves a value by
at most twice the largest logit error, so 1e-4 leaves a wide margin; the largest error seen is
printed. Ranks are vLLM's: 1 + the number of other tokens at least as likely.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers import BLOCK, assert_idle, greedy, hf_logits, make_llm, rand_ids  # noqa: E402

from nanovllm import Logprob, SamplingParams  # noqa: E402

TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def check_position(entry: dict, token: int, ref_lp: torch.Tensor, k: int, worst: list) -> None:
    """One position's {token id: Logprob} against the reference log-probabilities ref_lp [V]:
    exactly the chosen token and the k most likely ones, each with the reference's logprob and
    rank (1 + the tokens at least as likely; the top ones are ranks 1..k)."""
    k = min(k, len(ref_lp))
    assert all(isinstance(v, Logprob) for v in entry.values())
    top = sorted(((t, v) for t, v in entry.items() if v.rank <= k), key=lambda tv: tv[1].rank)
    assert [v.rank for _, v in top] == list(range(1, k + 1)), entry
    assert set(entry) == {token} | {t for t, _ in top}, entry
    ref_top = torch.topk(ref_lp, k).indices.tolist() if k else []
    for t, v in entry.items():
        worst.append(abs(v.logprob - ref_lp[t].item()))
        assert v.logprob == pytest.approx(ref_lp[t].item(), abs=TOL), (t, v)
        assert v.rank == int((ref_lp >= ref_lp[t]).sum()), (t, v)
    assert [t for t, _ in top] == ref_top


def ref_logprobs(path, ids):
    return torch.log_softmax(hf_logits(path, ids), dim=-1)


@pytest.mark.parametrize("k", [0, 1, 5])
def test_logprobs_and_prompt_logprobs_equal_transformers_log_softmax(llm, ckpt, k):
    prompts = [rand_ids(9, 600), rand_ids(2 * BLOCK + 3, 601), rand_ids(1, 602)]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=k, prompt_logprobs=k)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    worst = []
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        full = prompt + c.token_ids
        ref = ref_logprobs(ckpt, full)
        assert len(c.logprobs) == len(c.token_ids) == 10
        for j, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            check_position(entry, tok, ref[len(prompt) - 1 + j], k, worst)
            assert entry[tok].rank == 1 or k == 0  # greedy: the chosen token is the top one
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)),
                                                     abs=1e-6)
        assert c.cumulative_logprob == pytest.approx(sum(ref[len(prompt) - 1 + j, t].item()
                                                         for j, t in enumerate(c.token_ids)), abs=10 * TOL)
        # Prompt logprobs: None for the first token, then one entry per prompt token.
        pl = out.prompt_logprobs
        assert len(pl) == len(prompt) and pl[0] is None
        for p in range(1, len(prompt)):
            check_position(pl[p], prompt[p], ref[p - 1], k, worst)
    print(f"largest |logprob - transformers'|: {max(worst):.2e}")
    assert_idle(llm)


@pytest.mark.parametrize("chunked", [False, True], ids=["one_step", "chunked"])
def test_prompt_logprobs_of_a_one_token_request(ckpt, llm, chunked):
    """max_tokens=1 with prompt_logprobs, how a text is scored (an evaluation harness's
    loglikelihood): the prompt step makes the request's only token, so the request is retired
    when that step launches; its prompt logprobs, which arrive with the same step, are still
    every prompt position's (they used to be dropped as those of a finished request). Chunked:
    the earlier chunks' logprobs arrive first, the last chunk's with the token."""
    prompt = rand_ids(3 * BLOCK + 5, 620)
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=2)
    engine = make_llm(ckpt, device="cpu", max_num_batched_tokens=BLOCK + 3) if chunked else llm
    try:
        out = engine.generate([prompt], sp, use_tqdm=False)[0]
    finally:
        if chunked:
            engine.shutdown()
    pl = out.prompt_logprobs
    assert len(pl) == len(prompt) and pl[0] is None and len(out.outputs[0].token_ids) == 1
    ref, worst = ref_logprobs(ckpt, prompt), []
    for p in range(1, len(prompt)):
        check_position(pl[p], prompt[p], ref[p - 1], 2, worst)


def test_logprobs_are_the_raw_distribution_whatever_the_sampling(llm, ckpt):
    """Temperature, top-k, penalties and logit_bias change what is sampled, not the reported
    logprobs (vLLM V1: raw logits)."""
    prompt = rand_ids(14, 610)
    sp = SamplingParams(temperature=1.7, top_k=5, seed=3, max_tokens=12, ignore_eos=True, logprobs=3,
                        repetition_penalty=1.3, presence_penalty=0.5, logit_bias={7: 2.0})
    c = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    ref = ref_logprobs(ckpt, prompt + c.token_ids)
    worst = []
    for j, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        check_position(entry, tok, ref[len(prompt) - 1 + j], 3, worst)
    assert_idle(llm)


def test_prompt_logprobs_are_recomputed_on_prefix_hits_and_across_chunks(ckpt, llm):
    """A request that asks for prompt logprobs does not read the prefix cache (cached positions
    have no logits, vLLM recomputes too), and chunked prefill gives the same values."""
    prompt = rand_ids(3 * BLOCK + 5, 620)
    llm.generate([prompt], greedy(2), use_tqdm=False)  # now its blocks are cached
    sp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    ref = ref_logprobs(ckpt, prompt)
    worst = []
    for p in range(1, len(prompt)):
        check_position(out.prompt_logprobs[p], prompt[p], ref[p - 1], 2, worst)
    # The same request in 7-token chunks, next to one that reads the cache.
    chunked = make_llm(ckpt, max_num_batched_tokens=7)
    chunked.generate([prompt], greedy(2), use_tqdm=False)
    a, b = chunked.generate([prompt, prompt], [sp, greedy(2)], use_tqdm=False)
    assert b.num_cached_tokens == 3 * BLOCK and b.prompt_logprobs is None
    for p in range(1, len(prompt)):
        assert {t: v.rank for t, v in a.prompt_logprobs[p].items()} == \
            {t: v.rank for t, v in out.prompt_logprobs[p].items()}
        for t, v in a.prompt_logprobs[p].items():
            assert v.logprob == pytest.approx(out.prompt_logprobs[p][t].logprob, abs=TOL)
    assert_idle(chunked)


def test_logprobs_in_a_mixed_batch_change_nobodys_tokens(llm):
    prompts = [rand_ids(10, 630), rand_ids(20, 631), rand_ids(5, 632)]
    plain = [SamplingParams(temperature=0.8, seed=s, max_tokens=9, ignore_eos=True) for s in (1, 2, 3)]
    asking = [plain[0], SamplingParams(temperature=0.8, seed=2, max_tokens=9, ignore_eos=True, logprobs=4),
              SamplingParams(temperature=0.8, seed=3, max_tokens=9, ignore_eos=True, prompt_logprobs=1)]
    a = llm.generate(prompts, plain, use_tqdm=False)
    b = llm.generate(prompts, asking, use_tqdm=False)
    assert [o["token_ids"] for o in a] == [o["token_ids"] for o in b]
    assert b[0].outputs[0].logprobs is None and b[0].outputs[0].cumulative_logprob is None
    assert len(b[1].outputs[0].logprobs) == 9 and b[1].prompt_logprobs is None
    assert b[2].outputs[0].logprobs is None and len(b[2].prompt_logprobs) == 5


def test_stream_increments_carry_their_logprobs(llm):
    prompts = [rand_ids(11, 640), rand_ids(4, 641)]
    sp = SamplingParams(temperature=0.7, seed=9, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1, n=2)
    want = llm.generate(prompts, sp, use_tqdm=False)
    got = {}
    firsts = {}
    for inc in llm.stream(prompts, sp):
        got.setdefault((inc.index, inc.sample), []).extend(inc.logprobs)
        firsts.setdefault(inc.index, inc)
    for i, out in enumerate(want):
        for c in out.outputs:
            assert got[(i, c.index)] == c.logprobs
        # The request's prompt logprobs come with its first increment.
        assert firsts[i].prompt_logprobs == out.prompt_logprobs


def test_logprobs_with_detokenize_off_have_no_text(llm):
    out = llm.generate([rand_ids(6, 650)], SamplingParams(temperature=0, max_tokens=3, logprobs=1, detokenize=False),
                       use_tqdm=False)[0]
    assert out.outputs[0].text == ""
    assert all(v.decoded_token is None for e in out.outputs[0].logprobs for v in e.values())
    out = llm.generate([rand_ids(6, 650)], SamplingParams(temperature=0, max_tokens=3, logprobs=1), use_tqdm=False)[0]
    tok = llm.tokenizer
    for t, e in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert e[t].decoded_token == tok.decode([t])


def test_whole_vocabulary_logprobs_need_max_logprobs_minus_one(ckpt, llm):
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate([[1, 2]], SamplingParams(logprobs=-1, max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate([[1, 2]], SamplingParams(prompt_logprobs=21, max_tokens=1), use_tqdm=False)
    wide = make_llm(ckpt, max_logprobs=-1)
    c = wide.generate([[1, 2]], SamplingParams(temperature=0, logprobs=-1, max_tokens=2), use_tqdm=False)[0].outputs[0]
    vocab = wide.vocab_size
    assert all(len(e) == vocab for e in c.logprobs)
    assert all(sorted(v.rank for v in e.values()) == list(range(1, vocab + 1)) for e in c.logprobs)
    total = torch.tensor([v.logprob for v in c.logprobs[0].values()]).exp().sum().item()
    assert total == pytest.approx(1.0, abs=1e-4)


def test_logprobs_under_preemption(ckpt, llm):
    """Preempted and recomputed requests keep one logprob entry per token and one prompt entry
    per prompt token (no position computed twice)."""
    prompts = [rand_ids(30, 660 + i) for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    tight = make_llm(ckpt, num_kvcache_blocks=8)
    outs = tight.generate(prompts, sp, use_tqdm=False)
    assert tight.scheduler.num_preemptions > 0
    want = llm.generate(prompts, sp, use_tqdm=False)
    for a, b in zip(outs, want):
        assert a["token_ids"] == b["token_ids"]
        assert len(a.prompt_logprobs) == 30 and len(a.outputs[0].logprobs) == 30
        for x, y in zip(a.outputs[0].logprobs + a.prompt_logprobs[1:], b.outputs[0].logprobs + b.prompt_logprobs[1:]):
            assert x.keys() == y.keys()
            assert all(x[t].logprob == pytest.approx(y[t].logprob, abs=TOL) for t in x)
    assert_idle(tight)
