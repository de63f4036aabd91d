"""Logits processing end to end (CPU, float32, tiny model): presence / frequency / repetition
penalties, logit_bias, allowed_token_ids and bad_words give the greedy tokens of a reference
loop that applies the same rule to transformers' logits.

The references: transformers' RepetitionPenaltyLogitsProcessor for repetition_penalty; for
presence and frequency, vLLM's documented formula written here (logit -= frequency * count +
presence * [count > 0], counts of the output tokens); logit_bias adds, allowed_token_ids keeps,
bad_words bans a word's last token when the output ends with the rest. Order as vLLM's V1
sampler: allowed ids, bad words, bias, then penalties. Greedy tokens must be equal: the engine's
logits match transformers' to ~1e-6 here, and a token flip needs a near-tie below that.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers import assert_idle, greedy, hf_logits, make_llm, rand_ids  # noqa: E402

from nanovllm import SamplingParams  # noqa: E402

N = 16


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


PROMPTS = [rand_ids(7, 700), rand_ids(23, 701), [5, 5, 5, 5]]


def penalties(sampler):
    """The sampler's registered penalties extension (its device token counts)."""
    from nanovllm.features.logits.penalties import Penalties

    return next(e for e in sampler.processing.extensions if isinstance(e, Penalties))


def reference(path, prompt, n, *, repetition=1.0, frequency=0.0, presence=0.0, bias=None, allowed=None,
              bad=()):
    """Greedy decoding on transformers' logits with the rules applied in vLLM's order."""
    from transformers import RepetitionPenaltyLogitsProcessor

    ids = list(prompt)
    for _ in range(n):
        x = hf_logits(path, ids)[-1].clone()
        out = ids[len(prompt):]
        if allowed is not None:
            keep = torch.zeros_like(x, dtype=torch.bool)
            keep[list(allowed)] = True
            x[~keep] = float("-inf")
        for word in bad:
            if len(out) >= len(word) - 1 and (len(word) == 1 or out[len(out) - len(word) + 1:] == list(word[:-1])):
                x[word[-1]] = float("-inf")
        for t, b in (bias or {}).items():
            x[t] += b
        if repetition != 1.0:
            x = RepetitionPenaltyLogitsProcessor(repetition)(torch.tensor([ids]), x[None])[0]
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.numel()).float()
        x = x - frequency * counts - presence * (counts > 0).float()
        ids.append(int(x.argmax()))
    return ids[len(prompt):]


def run(llm, **kw):
    sp = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, **kw)
    return [o["token_ids"] for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


CASES = {
    "repetition": dict(repetition_penalty=1.6),
    "repetition_below_one": dict(repetition_penalty=0.7),
    "frequency": dict(frequency_penalty=1.2),
    "presence": dict(presence_penalty=1.5),
    "negative_presence": dict(presence_penalty=-0.8),
    "all_three": dict(repetition_penalty=1.3, frequency_penalty=0.6, presence_penalty=0.4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_penalties_give_the_reference_greedy_tokens(llm, ckpt, case):
    kw = CASES[case]
    got = run(llm, **kw)
    ref_kw = dict(repetition=kw.get("repetition_penalty", 1.0), frequency=kw.get("frequency_penalty", 0.0),
                  presence=kw.get("presence_penalty", 0.0))
    want = [reference(ckpt, p, N, **ref_kw) for p in PROMPTS]
    assert got == want
    plain = run(llm)
    assert got != plain, "the penalty changed nothing: the test cannot tell it is applied"
    assert_idle(llm)


def test_logit_bias_then_penalties(llm, ckpt):
    plain = run(llm)
    # Push two tokens the plain run never produces up, so the bias matters, with a repetition
    # penalty after it (the order shows: a biased token that repeats is penalised from its biased logit).
    unused = [t for t in range(300) if all(t not in p for p in plain)][:2]
    bias = {unused[0]: 6.0, unused[1]: 4.5, plain[0][0]: -3.0}
    got = run(llm, logit_bias=bias, repetition_penalty=1.4)
    want = [reference(ckpt, p, N, bias=bias, repetition=1.4) for p in PROMPTS]
    assert got == want and got != plain
    assert any(unused[0] in g or unused[1] in g for g in got)
    # JSON-style string keys (OpenAI's logit_bias) mean the same.
    assert run(llm, logit_bias={str(k): v for k, v in bias.items()}, repetition_penalty=1.4) == got


def test_allowed_token_ids(llm, ckpt):
    allowed = [3, 50, 97, 200, 201, 333]
    got = run(llm, allowed_token_ids=allowed)
    assert got == [reference(ckpt, p, N, allowed=allowed) for p in PROMPTS]
    assert all(t in allowed for g in got for t in g)
    # Sampled rows too (every token from the allowed set, seeded and reproducible).
    sp = SamplingParams(temperature=1.5, seed=4, max_tokens=N, ignore_eos=True, allowed_token_ids=allowed)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    assert all(t in allowed for o in outs for t in o["token_ids"])
    assert [o["token_ids"] for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == [o["token_ids"] for o in outs]


def _word_ids(tok, word):
    """The token sequences a bad word stands for (vLLM's rule, written here independently of
    the engine: the word alone, and after a space when that is as many tokens and starts with
    another token)."""
    plain = tok.encode(word.lstrip(), add_special_tokens=False)
    spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
    out = [tuple(plain)]
    if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
        out.append(tuple(spaced))
    return out


def _contains(seq, word):
    return any(list(seq[i:i + len(word)]) == list(word) for i in range(len(seq) - len(word) + 1))


def test_bad_words_single_and_multi_token(llm, ckpt):
    tok = llm.tokenizer
    plain = run(llm)
    # Words taken from the plain greedy output itself, so that the ban must change it: one that
    # is a single token and one of two tokens (as the tokenizer encodes them).
    single = multi = None
    for out in plain:
        for j in range(len(out) - 1):
            w1 = tok.decode([out[j]])
            if single is None and w1.strip() and _word_ids(tok, w1)[0] == (out[j],):
                single = w1
            w2 = tok.decode(out[j:j + 2])
            ids = _word_ids(tok, w2)
            if multi is None and w2.strip() and len(ids[0]) == 2 and any(_contains(o, ids[0]) for o in plain):
                multi = w2
    assert single and multi, "no usable bad word in the plain output"
    for words in ([single], [multi], [single, multi]):
        ids = [w for word in words for w in _word_ids(tok, word)]
        got = run(llm, bad_words=words)
        assert got == [reference(ckpt, p, N, bad=ids) for p in PROMPTS], words
        assert got != plain
        assert not any(_contains(g, w) for g in got for w in ids)
    assert_idle(llm)


def test_penalised_rows_in_a_mixed_batch_with_n_and_preemption(ckpt, llm):
    """Penalised rows next to plain ones, n = 2 samples with their own counts, the same under
    preemption (the counts stay on the device while a request is recomputed)."""
    prompts = [rand_ids(30, 710), rand_ids(30, 711), rand_ids(30, 712), rand_ids(30, 713)]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.5, n=2),
              greedy(30),
              SamplingParams(temperature=0.9, seed=8, max_tokens=30, ignore_eos=True, frequency_penalty=0.9,
                             presence_penalty=0.3),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logit_bias={7: 3.0},
                             bad_words=["a"], allowed_token_ids=list(range(0, 400)))]
    alone = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    assert alone[0].outputs[0].token_ids == alone[0].outputs[1].token_ids  # greedy samples agree
    assert alone[0].outputs[0].token_ids == reference(ckpt, prompts[0], 30, repetition=1.5)
    batched = llm.generate(prompts, params, use_tqdm=False)
    tight = make_llm(ckpt, num_kvcache_blocks=8)
    squeezed = tight.generate(prompts, params, use_tqdm=False)
    assert tight.scheduler.num_preemptions > 0
    for outs in (batched, squeezed):
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in alone]
    assert_idle(tight)
    assert_idle(llm)
    assert not penalties(tight.model_runner.sampler).counts.slots, "penalty state left behind"


@pytest.mark.parametrize("bad", [
    dict(presence_penalty=2.5), dict(presence_penalty=float("nan")), dict(frequency_penalty=-3),
    dict(repetition_penalty=0.0), dict(repetition_penalty=-1.0), dict(repetition_penalty=float("inf")),
    dict(logit_bias={1: float("inf")}), dict(logit_bias={-1: 1.0}), dict(logit_bias={"x": 1.0}),
    dict(logit_bias=[1, 2]), dict(allowed_token_ids=[]), dict(allowed_token_ids=[-1]),
    dict(allowed_token_ids=[1.5]), dict(bad_words=[""]), dict(bad_words="word"), dict(bad_words=[3]),
])
def test_bad_values_are_value_errors_naming_the_field(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**bad)


def test_requests_that_use_none_of_it_take_the_plain_path(llm, monkeypatch):
    """No row asks for logits processing or logprobs: no processing tensors are built and none
    of their device work runs (the sampler gets the raw logits), also next to n > 1 requests."""
    from nanovllm.features.logits import logprobs

    def forbidden(*a, **k):
        raise AssertionError("logits processing ran for requests that use none of it")

    sampler = llm.model_runner.sampler
    # Every extension an earlier request of this module registered, and any registered now.
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1, logprobs=1, repetition_penalty=1.2,
                                             logit_bias={3: 1.0}), use_tqdm=False)
    for ext in sampler.processing.extensions:
        monkeypatch.setattr(ext, "build", forbidden)
        monkeypatch.setattr(ext, "transform", forbidden)
    monkeypatch.setattr(sampler.processing.logprobs, "build", forbidden)
    monkeypatch.setattr(sampler.processing.logprobs, "gather", forbidden)
    monkeypatch.setattr(logprobs, "gather_logprobs", forbidden)
    plain = [SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=8), greedy(8),
             SamplingParams(temperature=0.7, n=3, seed=2, max_tokens=6, min_tokens=2, stop=["x"])]
    outs = llm.generate(PROMPTS, plain, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [1, 1, 3]
    assert sampler._cache[2] is None
    monkeypatch.undo()
    assert_idle(llm)


PLAIN_GENERATE = """
import sys
sys.path.insert(0, {tests!r})
from nanovllm import LLM, SamplingParams
llm = LLM({ckpt!r}, kvcache_block_size=16, num_kvcache_blocks=32)
llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
loaded = sorted(m for m in sys.modules if m.startswith("nanovllm.features.logits"))
assert not loaded, loaded
assert llm.model_runner.sampler.processing is None  # no extension, no logprobs reader
llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3, presence_penalty=0.5, logprobs=1),
             use_tqdm=False)
loaded = sorted(m for m in sys.modules if m.startswith("nanovllm.features.logits"))
assert loaded == ["nanovllm.features.logits", "nanovllm.features.logits.logprobs",
                  "nanovllm.features.logits.penalties", "nanovllm.features.logits.processing"], loaded
print("ok")
"""


def test_plain_greedy_generate_loads_no_logits_extension(ckpt):
    """The logits extensions are features: a plain greedy generate imports none of their
    modules; a request that asks for penalties and logprobs registers exactly those."""
    import subprocess

    code = PLAIN_GENERATE.format(tests=os.path.dirname(__file__), ckpt=str(ckpt))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
