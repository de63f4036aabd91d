"""Speculative decoding (`speculative_config`, features/speculative/) on CPU, float32, tiny Qwen3.

The check is exactness: a verification step samples every drafted position with the noise a step
without drafts draws there (the sampler's noise is a function of (seed, token index)), and keeps
a draft only when it equals the token sampled before it. So, for every seed, greedy or sampled,
the tokens must be *equal* to those of the same engine without speculation (which the other
modules check against transformers), and equal per seed implies the output distribution is the
target's exactly. Drafts come from the real prompt-lookup proposer and from an oracle that knows
the plain engine's continuation and spoils some drafts, so that long runs of accepted drafts,
rejections at every position and finishes inside a draft all happen.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from helpers import assert_idle, greedy, hf_reference, make_llm, rand_ids  # noqa: E402

from nanovllm import SamplingParams  # noqa: E402
from nanovllm.features.speculative.drafting import draft_counts  # noqa: E402
from nanovllm.features.speculative.ngram import NgramProposer, propose_ngram  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Prompts that repeat themselves, so prompt lookup finds matches.
PROMPTS = [rand_ids(6, 1) * 3, rand_ids(4, 2) * 4 + rand_ids(3, 3), rand_ids(9, 4) + rand_ids(2, 5) * 5]


@pytest.fixture(scope="module")
def plain(ckpt):
    return make_llm(ckpt)


@pytest.fixture(scope="module")
def spec(ckpt):
    return make_llm(ckpt, speculative_config=NGRAM)


def tokens(outputs) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


class Oracle:
    """Drafts the plain engine's own continuation of each prompt (`reference`: prompt tuple ->
    completion; nothing for other prompts), spoiling the draft at position (proposal count % (k + 1)) so that every
    rejection position occurs (k + 1: none spoilt)."""

    def __init__(self, reference: dict[tuple, list[int]]):
        self.reference, self.calls = reference, 0

    def __call__(self, seq, k):
        prompt = tuple(seq.token_ids[:seq.num_prompt_tokens])
        done = seq.num_completion_tokens
        d = list(self.reference.get(prompt, [])[done:done + k])
        spoil = self.calls % (k + 1)
        self.calls += 1
        if spoil < len(d):
            d[spoil] = (d[spoil] + 1) % 400
        return d


@pytest.fixture
def oracle(monkeypatch, plain):
    def install(prompts, params):
        ref = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, plain.generate(prompts, params,
                                                                                                use_tqdm=False))}
        o = Oracle(ref)
        monkeypatch.setattr(NgramProposer, "propose_one", lambda self, seq, k: o(seq, k))
        return o
    return install


# ---------------------------------------------------------------- options


@pytest.mark.parametrize("config, error, match", [
    ({"method": "nope", "num_speculative_tokens": 2}, ValueError, "method"),
    ({"method": "ngram"}, ValueError, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, ValueError, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, ValueError, "lookahead"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     ValueError, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, ValueError, "draft"),
    ({"method": "eagle", "model": "x", "num_speculative_tokens": 2}, NotImplementedError, "eagle"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, ValueError, "needs 'model'"),
    ({"method": "draft_model", "model": "/no/such/folder", "num_speculative_tokens": 2}, FileNotFoundError,
     "no/such/folder"),
    ("ngram", ValueError, "dict"),
])
def test_bad_speculative_config_is_a_clear_error(ckpt, plain, config, error, match):
    with pytest.raises(error, match=match):
        make_llm(ckpt, speculative_config=config)
    assert tokens(plain.generate([PROMPTS[0]], greedy(4), use_tqdm=False))  # others unaffected


def test_prompt_lookup_takes_the_longest_match_and_its_earliest_occurrence():
    seq = [1, 2, 3, 9, 1, 2, 3, 8, 5, 2, 3]
    assert propose_ngram(seq, 3, 1, 3) == [9, 1, 2]      # "2 3" (no "5 2 3" earlier): first after 1 2 3
    assert propose_ngram(seq, 1, 1, 1) == [9]            # "3": earliest occurrence
    assert propose_ngram([4, 5, 6, 7], 2, 1, 3) == []    # no repeat
    assert propose_ngram([4, 5, 4], 5, 1, 2) == [5, 4]   # runs into the end: fewer than k
    assert propose_ngram([7, 7, 7, 7], 2, 2, 2) == [7, 7]


# ---------------------------------------------------------------- exactness


def test_greedy_equals_plain_decoding_and_transformers(ckpt, plain, spec):
    params = greedy(40)
    want = tokens(plain.generate(PROMPTS, params, use_tqdm=False))
    before = draft_counts(spec.scheduler).num_drafts
    assert tokens(spec.generate(PROMPTS, params, use_tqdm=False)) == want
    assert draft_counts(spec.scheduler).num_drafts > before  # prompt lookup drafted
    assert want[0] == hf_reference(ckpt, PROMPTS[0], 40)
    assert_idle(spec)


@pytest.mark.parametrize("extra", [{}, {"top_p": 0.8, "top_k": 20}, {"min_p": 0.1, "temperature": 0.7}])
def test_every_seed_samples_what_plain_decoding_samples(plain, spec, oracle, extra):
    """Equal tokens for each of 24 seeds (and filters): the distribution is the target's."""
    prompts = [PROMPTS[i % 3] for i in range(24)]
    params = [SamplingParams(temperature=extra.get("temperature", 1.0), seed=s, max_tokens=24, ignore_eos=True,
                             **{k: v for k, v in extra.items() if k != "temperature"}) for s in range(24)]
    want = tokens(plain.generate(prompts, params, use_tqdm=False))
    assert tokens(spec.generate(prompts, params, use_tqdm=False)) == want  # prompt lookup
    o = oracle(prompts[:3], params[:3])  # the oracle knows seeds 0-2's continuations
    counts = draft_counts(spec.scheduler)
    accepted = counts.num_accepted_tokens
    assert tokens(spec.generate(prompts[:3], params[:3], use_tqdm=False)) == want[:3]
    assert o.calls and counts.num_accepted_tokens > accepted
    assert_idle(spec)


def test_oracle_drafts_are_accepted_and_rejected_at_every_position(plain, spec, oracle):
    params = greedy(48)
    o = oracle(PROMPTS, params)
    c = draft_counts(spec.scheduler)
    before = (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, list(c.accepted_per_position))
    assert tokens(spec.generate(PROMPTS, params, use_tqdm=False)) == tokens(plain.generate(PROMPTS, params,
                                                                                                use_tqdm=False))
    drafts, drafted, accepted = (c.num_drafts - before[0], c.num_draft_tokens - before[1],
                                 c.num_accepted_tokens - before[2])
    # (the oracle spoils position 0, 1, 2, 3 or none in turn: about half the drafts are kept)
    assert o.calls >= drafts > 0 and drafted >= accepted >= drafted // 3
    per_pos = [a - (before[3][j] if j < len(before[3]) else 0) for j, a in enumerate(c.accepted_per_position)]
    assert sum(per_pos) == accepted and all(n > 0 for n in per_pos[:4])
    # Fewer verification steps than tokens: drafts saved steps.
    assert drafts + sum(1 for _ in PROMPTS) < 3 * 48
    assert_idle(spec)


@pytest.mark.parametrize("finish", ["stop_token", "max_tokens", "stop_string"])
def test_a_finish_inside_accepted_drafts_ends_there(plain, spec, oracle, finish):
    ref = tokens(plain.generate(PROMPTS, greedy(40), use_tqdm=False))
    kw = {"max_tokens": 40}
    if finish == "stop_token":
        kw["stop_token_ids"] = [ref[0][17]]
    elif finish == "max_tokens":
        kw["max_tokens"] = 19
    else:
        kw["stop"] = [plain.get_tokenizer().decode(ref[1][10:12])]
    params = greedy(**kw)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    oracle(PROMPTS, params)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert (list(g.outputs[0].token_ids), g.outputs[0].text, g.outputs[0].finish_reason) == \
            (list(w.outputs[0].token_ids), w.outputs[0].text, w.outputs[0].finish_reason)
    assert_idle(spec)


def test_prefix_cache_holds_only_accepted_tokens(ckpt, spec, oracle):
    """A follow-up prompt made of a finished request's prompt and output hits the blocks that
    request committed; had a rejected draft's K/V been committed, its greedy tokens would differ
    from a run that computes everything."""
    first = PROMPTS[0]
    oracle([first], greedy(50))
    out = tokens(spec.generate([first], greedy(50), use_tqdm=False))[0]
    follow = first + out[:40]
    exact = make_llm(ckpt, enable_prefix_caching=False)
    want = tokens(exact.generate([follow], greedy(12), use_tqdm=False))
    got = spec.generate([follow], greedy(12), use_tqdm=False)
    assert got[0].num_cached_tokens >= 48 and tokens(got) == want


def test_n_samples_preemption_and_mixed_steps_stay_exact(ckpt, oracle):
    """n = 2, a KV cache so small that requests are preempted, and mixed steps (the server's
    policy): equal to the same engine without drafts."""
    kw = dict(num_kvcache_blocks=14, mixed_steps=True, max_num_batched_tokens=64)
    base = make_llm(ckpt, **kw)
    prompts = PROMPTS + [rand_ids(20, 9)]
    params = SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=30, ignore_eos=True)
    want = tokens(base.generate(prompts, params, use_tqdm=False))
    llm = make_llm(ckpt, speculative_config=NGRAM, **kw)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    assert base.scheduler.num_preemptions > 0 and llm.scheduler.num_preemptions > 0
    assert draft_counts(llm.scheduler).num_drafts > 0
    assert_idle(llm)


def test_penalty_and_logprob_requests_beside_drafting_ones(plain, spec, oracle):
    """Rows with penalties are not drafted; rows asking for logprobs are, and get the target's
    logprobs of every accepted token (those of plain decoding); a batch mixing them with plain
    drafting rows gives every request its plain-decoding tokens."""
    params = [greedy(24), SamplingParams(temperature=0.8, seed=3, max_tokens=24, repetition_penalty=1.3,
                                         ignore_eos=True), greedy(24, logprobs=2)]
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    o = oracle(PROMPTS, params)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    assert tokens(got) == tokens(want) and o.calls
    for w, g in zip(want[2].outputs[0].logprobs, got[2].outputs[0].logprobs):
        assert w.keys() == g.keys()
        assert all(abs(w[t].logprob - g[t].logprob) < 1e-4 and w[t].rank == g[t].rank for t in w)
    assert abs(got[2].outputs[0].cumulative_logprob - want[2].outputs[0].cumulative_logprob) < 1e-3


def test_stream_adds_up_to_generate(spec, oracle):
    params = greedy(30)
    oracle(PROMPTS, params)
    whole = spec.generate(PROMPTS, params, use_tqdm=False)
    oracle(PROMPTS, params)
    pieces = {i: ([], "") for i in range(len(PROMPTS))}
    longest = 0
    for inc in spec.stream(PROMPTS, params):
        ids, text = pieces[inc.index]
        pieces[inc.index] = (ids + list(inc.token_ids), text + inc.text)
        longest = max(longest, len(inc.token_ids))
    assert [pieces[i] for i in range(len(PROMPTS))] == [(list(o.outputs[0].token_ids), o.outputs[0].text)
                                                        for o in whole]
    assert longest > 1  # accepted drafts arrive as increments of several tokens


def test_get_metrics_reports_vllms_spec_decode_counters(ckpt, oracle):
    llm = make_llm(ckpt, speculative_config=NGRAM, disable_log_stats=False)
    oracle(PROMPTS, greedy(30))
    llm.generate(PROMPTS, greedy(30), use_tqdm=False)
    m = {x.name: x for x in llm.get_metrics()}
    drafts, drafted = m["vllm:spec_decode_num_drafts"].value, m["vllm:spec_decode_num_draft_tokens"].value
    accepted = m["vllm:spec_decode_num_accepted_tokens"].value
    assert 0 < drafts <= drafted and 0 < accepted <= drafted
    assert sum(m["vllm:spec_decode_num_accepted_tokens_per_pos"].values) == accepted
    assert "vllm:spec_decode_num_drafts" not in {x.name for x in make_llm(ckpt, disable_log_stats=False).get_metrics()}


def test_the_server_takes_speculative_config_and_exports_the_counters(ckpt, plain):
    """`--speculative-config JSON` on the OpenAI server: the completion's tokens are plain
    decoding's, and /metrics counts the drafts (vLLM's names)."""
    import json

    import httpx
    import openai
    from helpers import BLOCK

    from nanovllm.serve.launcher import ServerProcess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = ["--device", "cpu", "--kvcache-block-size", str(BLOCK), "--num-kvcache-blocks", "128",
            "--log-level", "warning", "--speculative-config", json.dumps(NGRAM)]
    server = ServerProcess(ckpt, args, timeout=180, cwd=root, env=env)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)
        # (PROMPTS[2]'s greedy continuation repeats a token: prompt lookup drafts it)
        out = client.completions.create(model=ckpt, prompt=PROMPTS[2], max_tokens=40, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.choices[0].token_ids == tokens(plain.generate([PROMPTS[2]], greedy(40), use_tqdm=False))[0]
        deadline = time.monotonic() + 20  # the engine's figures reach the server after its next iteration
        while True:
            text = httpx.get(server.url + "/metrics", timeout=10).text
            drafts = [line for line in text.splitlines() if line.startswith("vllm:spec_decode_num_drafts_total")]
            if (drafts and float(drafts[0].split()[-1]) > 0) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert drafts and float(drafts[0].split()[-1]) > 0, text[-2000:]
    finally:
        server.stop(30)


# ---------------------------------------------------------------- draft model


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A draft with the target's vocabulary and shapes but other weights: it mostly misses."""
    import tiny_model as tm

    return tm.make_tiny_qwen3(tmp_path_factory.mktemp("draft"), seed=5, num_layers=1)


def draft_config(path, k=3):
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


def test_a_draft_model_that_is_the_target_drafts_every_greedy_token(ckpt, plain):
    llm = make_llm(ckpt, speculative_config=draft_config(ckpt))
    want = tokens(plain.generate(PROMPTS, greedy(40), use_tqdm=False))
    assert tokens(llm.generate(PROMPTS, greedy(40), use_tqdm=False)) == want
    c = draft_counts(llm.scheduler)
    assert c.num_drafts > 0 and c.num_accepted_tokens == c.num_draft_tokens  # greedy drafts of the same model
    seeded = [SamplingParams(temperature=0.9, seed=s, max_tokens=30, ignore_eos=True) for s in range(3)]
    assert tokens(llm.generate(PROMPTS, seeded, use_tqdm=False)) == tokens(plain.generate(PROMPTS, seeded,
                                                                                            use_tqdm=False))
    assert 0 < c.num_accepted_tokens < c.num_draft_tokens
    assert_idle(llm)


def test_another_draft_model_preemption_n2_and_prefix_hits_stay_exact(ckpt, other_draft):
    """A draft that mostly misses, a cache so small that requests are preempted (the draft then
    recomputes its K/V), n = 2, mixed steps, and a second run hitting the prefix cache (whose
    blocks carry the target's K/V only): equal to the same engine without drafts."""
    kw = dict(num_kvcache_blocks=14, mixed_steps=True, max_num_batched_tokens=64)
    base = make_llm(ckpt, **kw)
    prompts = PROMPTS + [rand_ids(20, 9)]
    params = SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=30, ignore_eos=True)
    want = tokens(base.generate(prompts, params, use_tqdm=False))
    llm = make_llm(ckpt, speculative_config=draft_config(other_draft, 2), **kw)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    assert llm.scheduler.num_preemptions > 0 and llm.block_manager.num_prefix_hit_tokens > 0
    assert draft_counts(llm.scheduler).num_drafts > 0
    assert_idle(llm)


def test_a_draft_with_another_vocabulary_or_tensor_parallelism_is_refused(ckpt, tmp_path):
    import tiny_model as tm

    wrong = tm.make_tiny_qwen3(tmp_path / "wrong", vocab_size=700)
    with pytest.raises(ValueError, match="vocabulary"):
        make_llm(ckpt, speculative_config=draft_config(wrong))
    with pytest.raises(NotImplementedError, match="tensor_parallel_size"):
        make_llm(ckpt, tensor_parallel_size=2, speculative_config=draft_config(ckpt))


def test_the_kv_budget_charges_the_drafts_share_of_each_block(ckpt):
    """On the CPU the cache has a fixed budget (1 GiB): a draft as large as the target keeps as
    many bytes per block, so the engine gets half the blocks."""
    from nanovllm import LLM

    plain = LLM(ckpt, kvcache_block_size=16)
    spec = LLM(ckpt, kvcache_block_size=16, speculative_config=draft_config(ckpt))
    assert spec.block_manager.num_blocks == plain.block_manager.num_blocks // 2
    assert spec.scheduler.hooks[0].proposer.runner.num_blocks == spec.block_manager.num_blocks
    plain.shutdown()
    spec.shutdown()


def test_seeded_tokens_do_not_depend_on_batch_order(ckpt):
    llm = make_llm(ckpt, speculative_config=draft_config(ckpt, 2))  # (sampled: some drafts kept)
    prompts = PROMPTS * 3
    params = [SamplingParams(temperature=0.8, seed=40 + i, max_tokens=20, ignore_eos=True) for i in range(9)]
    forward = tokens(llm.generate(prompts, params, use_tqdm=False))
    backward = tokens(llm.generate(prompts[::-1], params[::-1], use_tqdm=False))[::-1]
    assert forward == backward and draft_counts(llm.scheduler).num_accepted_tokens > 0


@pytest.fixture(scope="module")
def vocab16(tmp_path_factory):
    """A target and a draft over a 16-token vocabulary (exact distributions are enumerable)."""
    import tiny_model as tm

    kw = dict(vocab_size=16, with_tokenizer=False)
    return (tm.make_tiny_qwen3(tmp_path_factory.mktemp("v16"), **kw),
            tm.make_tiny_qwen3(tmp_path_factory.mktemp("v16d"), seed=9, num_layers=1, **kw))


def test_sampled_tokens_follow_the_exact_distribution(vocab16):
    """3,000 seeded samples of 3 tokens after a fixed prompt, with a draft model drafting 2:
    the empirical distribution of each token (the 2nd and 3rd come through verification) is
    within total variation 0.072 of the exact marginal computed with transformers.
    Bound: E[TV] <= 0.5 * sqrt(V / N) = 0.037 for V = 16, N = 3000 (Cauchy-Schwarz over the bins'
    standard deviations), and TV moves by at most 1/N per sample, so P(TV > E + 0.035) <=
    exp(-2 N 0.035^2) < 1e-3 (McDiarmid). The seeds are fixed: the test is deterministic."""
    import torch

    import tiny_model as tm
    from nanovllm import LLM

    target, draft = vocab16
    prompt, n = [1, 2, 3, 4], 3000
    llm = LLM(target, skip_tokenizer_init=True, kvcache_block_size=16, num_kvcache_blocks=256,
              speculative_config=draft_config(draft, 2))
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True) for s in range(n)]
    samples = torch.tensor([t for i in range(0, n, 20)  # 20 at a time: small batches draft
                            for t in tokens(llm.generate([prompt] * 20, params[i:i + 20], use_tqdm=False))])
    assert draft_counts(llm.scheduler).num_accepted_tokens > 0
    hf = tm.load_hf_model(target)
    with torch.inference_mode():
        marginal = torch.zeros(1, dtype=torch.float64)
        paths = torch.tensor([prompt])
        for step in range(3):  # exact: every path of length `step` weighted by its probability
            p = torch.softmax(hf(paths).logits[:, -1].double(), -1)  # [paths, 16]
            joint = marginal.exp()[:, None] * p if step else p
            exact = joint.sum(0)
            empirical = torch.bincount(samples[:, step], minlength=16).double() / n
            assert 0.5 * (empirical - exact).abs().sum() < 0.072, (step, empirical, exact)
            marginal = joint.reshape(-1).log()
            paths = torch.cat([paths.repeat_interleave(16, 0), torch.arange(16).repeat(len(paths))[:, None]], 1)


@pytest.mark.parametrize("config, keep", [({"synthetic_acceptance_rate": 1.0}, 1.0),
                                          ({"synthetic_acceptance_rate": 0.0}, 0.0),
                                          ({"synthetic_acceptance_rate": 0.7}, 0.443),
                                          ({"synthetic_acceptance_length": 2.5}, 0.5)])
def test_synthetic_acceptance_keeps_drafts_at_the_asked_rate(ckpt, config, keep):
    """rejection_sample_method='synthetic' (benchmarks): drafts kept at the asked rate whatever
    they are; rate 0.7 over k = 4 keeps (0.7 + 0.49 + 0.343 + 0.24) / 4 = 0.443 of the drafts on
    average (about 300 verifications here: within 0.1), length 2.5 over k = 3 keeps one and half
    of another: 1.5 / 3."""
    k = 3 if "synthetic_acceptance_length" in config else 4
    spec = {"method": "ngram", "num_speculative_tokens": k, "rejection_sample_method": "synthetic", **config}
    llm = make_llm(ckpt, speculative_config=spec)
    out = llm.generate(PROMPTS * 4, [SamplingParams(temperature=0.8, seed=i, max_tokens=80, ignore_eos=True)
                                     for i in range(12)], use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 80 for o in out)
    c = draft_counts(llm.scheduler)
    assert c.num_drafts > 100 and abs(c.num_accepted_tokens / c.num_draft_tokens - keep) < 0.1
    assert_idle(llm)


@pytest.mark.parametrize("extra, match", [
    ({"rejection_sample_method": "synthetic"}, "exactly one"),
    ({"rejection_sample_method": "synthetic", "synthetic_acceptance_rate": 1.5}, r"\[0, 1\]"),
    ({"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.5, 0.9]}, "non-increasing"),
    ({"synthetic_acceptance_rate": 0.5}, "synthetic"),
    ({"rejection_sample_method": "fancy"}, "standard"),
])
def test_bad_synthetic_settings_are_clear_errors(ckpt, extra, match):
    with pytest.raises(ValueError, match=match):
        make_llm(ckpt, speculative_config={"method": "ngram", "num_speculative_tokens": 2, **extra})


# ---------------------------------------------------------------- review regressions


@pytest.fixture
def always_draft(monkeypatch):
    """Every row that may draft drafts k copies of its newest token (lookup or not)."""
    monkeypatch.setattr(NgramProposer, "propose_one", lambda self, seq, k: [seq.token_ids[-1]] * k)


def test_a_step_that_forks_or_plans_prompt_logprobs_beside_drafting_rows(ckpt, always_draft):
    """Mixed steps: a request arrives (n = 2, or with prompt logprobs) while others draft; its
    prompt's last step forks its samples / returns all its prompt logprobs, as without drafts.
    A prompt whose last chunk is one token after a prefix hit is not taken for a decode row."""
    kw = dict(mixed_steps=True, max_num_batched_tokens=32)
    base, llm = make_llm(ckpt, **kw), make_llm(ckpt, speculative_config=NGRAM, **kw)
    long = rand_ids(90, 8)
    for params in (SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=12, ignore_eos=True),
                   greedy(12, prompt_logprobs=1)):
        prompts, ps = PROMPTS + [long], [greedy(40)] * 3 + [params]
        want, got = base.generate(prompts, ps, use_tqdm=False), llm.generate(prompts, ps, use_tqdm=False)
        assert tokens(got) == tokens(want)
        assert [len(o.prompt_logprobs or []) for o in got] == [len(o.prompt_logprobs or []) for o in want]
    prompt, params = rand_ids(33, 7), SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=12, ignore_eos=True)
    for engine in (base, llm):
        engine.generate([prompt], greedy(2), use_tqdm=False)  # the prefix cache holds 32 of its 33 tokens
    assert tokens(llm.generate([prompt], params, use_tqdm=False)) == tokens(base.generate([prompt], params,
                                                                                             use_tqdm=False))
    assert draft_counts(llm.scheduler).num_drafts > 0
    assert_idle(llm)


def test_draft_model_catch_up_longer_than_max_num_seqs(ckpt):
    """A request that ran undrafted for a while (the batch was above disable_by_batch_size)
    catches up on more tokens than the draft's decode buffers hold rows: in parts."""
    llm = make_llm(ckpt, max_num_seqs=8, speculative_config={**draft_config(ckpt), "disable_by_batch_size": 1})
    first = llm.add_request(rand_ids(10, 1), greedy(60))
    for _ in range(6):
        llm.step()
    llm.add_request(rand_ids(10, 2), greedy(30))  # two rows: no drafts while both run
    while llm.has_unfinished():
        llm.step()
    assert first.completion_token_ids == tokens(make_llm(ckpt).generate([rand_ids(10, 1)], greedy(60),
                                                                         use_tqdm=False))[0]
    assert draft_counts(llm.scheduler).num_accepted_tokens > 0
    assert_idle(llm)
