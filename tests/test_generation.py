"""End-to-end tests of sampling, stopping, streaming and chat through `LLM` (CPU, float32, tiny model).

1. seeds: a seeded request gives the same tokens whatever else is in the batch (other parameters,
   greedy rows, its position, chunked prefill, preemption, the engine's seed); different seeds
   differ; without seeds the engine's `seed` makes whole runs reproducible; greedy rows of a mixed
   batch equal a greedy-only run; filters that leave one token (top_k=1, tiny top_p, min_p=1) are greedy,
   filters switched off change nothing, and many seeds draw the first token from exactly the
   temperature-scaled, filtered distribution (support and frequencies, against transformers' logits);
2. stopping: stop_token_ids (first occurrence, kept as the last token), min_tokens (EOS and stop ids
   suppressed until reached, exactly at the boundary), ignore_eos, max_tokens ("length");
3. stop strings, derived from greedy runs' own text: across a token boundary, multi-byte characters,
   the earliest of several wins, never produced, generated text only (not the prompt);
4. streaming: increments concatenate to generate()'s output, one final increment, no broken
   UTF-8 character shown, early close leaves the engine idle and usable;
5. chat: through the tokenizer's chat template (enable_thinking), lists of conversations, bad input;
6. EOS ids from generation_config.json and from the tokenizer.

Greedy references come from the engine itself (tests/test_llm.py checks greedy against transformers).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers import (  # noqa: E402
    BPE_VOCAB,
    EOS_IDS,
    assert_idle,
    copy_checkpoint,
    edit_json,
    greedy,
    make_llm,
)

from nanovllm import SamplingParams  # noqa: E402

FFFD = "\ufffd"
N = 40  # tokens of every greedy reference

PROMPTS = [
    "Hello, world!",
    "The capital of France is",
    "你好",
    "def add(a, b):",
    "Once upon a time",
    "Emoji: 😀 🚀",
    "Café, crème brûlée",
    "SELECT id, name FROM users",
    "Привет, мир!",
    "for i in range(10):",
]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tok(llm):
    return llm.tokenizer


@pytest.fixture(scope="module")
def refs(llm):
    """prompt -> greedy output (N tokens, EOS ignored) of the engine, one batched run."""
    outs = llm.generate(PROMPTS, greedy(N), use_tqdm=False)
    for o in outs:
        assert len(o["token_ids"]) == N and o["finish_reason"] == "length"
    return dict(zip(PROMPTS, outs))


def decode(tok, ids) -> str:
    return tok.decode(list(ids), skip_special_tokens=True)


def sampled(max_tokens=24, **kw):
    kw.setdefault("ignore_eos", True)
    kw.setdefault("temperature", 0.8)
    return SamplingParams(max_tokens=max_tokens, **kw)


def ids_of(outputs):
    return [o["token_ids"] for o in outputs]


def stop_point(tok, ids, stops):
    """Where a request whose greedy continuation is `ids` must end with stop strings `stops`:
    (number of tokens, text) or None if no stop string appears.

    The text is the full text cut before the earliest occurrence of any stop string. The request
    ends at the first token after which that occurrence is in stable text: text whose decode does
    not end in an incomplete character (U+FFFD), which is held back until a later token completes it.
    """
    full = decode(tok, ids)
    hits = [full.find(s) for s in stops if s in full]
    if not hits:
        return None
    cut = min(hits)
    for j in range(1, len(ids) + 1):
        text = decode(tok, ids[:j])
        if any(s in text for s in stops) and not text.endswith(FFFD):
            return j, full[:cut]
    return len(ids), full[:cut]  # found only when the final text is flushed


def find_fresh_token_case(refs, lo=3, hi=14):
    """(prompt, ids, k): greedy token k is an ordinary token that does not occur before k, and no
    natural EOS comes before it."""
    for prompt, out in refs.items():
        ids = out["token_ids"]
        for k in range(lo, hi):
            if any(t in EOS_IDS for t in ids[:k]):
                break
            if ids[k] < BPE_VOCAB and ids[k] not in ids[:k]:
                return prompt, ids, k
    pytest.fail("no greedy reference has a fresh ordinary token at a step in [3, 14)")


# ============================================================================================
# 1. Seeds and mixed batches
# ============================================================================================

TARGET_PROMPT = "Once upon a time"


def target_params(seed=7, max_tokens=24):
    return SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def test_seeded_request_is_independent_of_the_batch(llm, refs):
    alone = llm.generate([TARGET_PROMPT], target_params(), use_tqdm=False)[0]
    assert len(alone["token_ids"]) == 24 and alone["finish_reason"] == "length"
    again = llm.generate([TARGET_PROMPT], target_params(), use_tqdm=False)[0]
    assert again["token_ids"] == alone["token_ids"], "the same seeded request gave different tokens twice"
    assert again["text"] == alone["text"]

    # Inside batches of other requests with other parameters (greedy rows mixed in, unseeded rows,
    # top_p-only rows which need a full sort, min_p rows), at different positions.
    batch_a = [
        ("Hello, world!", greedy(N)),
        (TARGET_PROMPT, target_params()),
        ("def add(a, b):", sampled(20, temperature=1.3, min_p=0.05, seed=3)),
        ("你好", sampled(10, temperature=0.5, top_k=5)),  # unseeded
        ("The capital of France is", greedy(N)),
    ]
    batch_b = [
        ("SELECT id, name FROM users", sampled(30, top_p=0.5)),
        ("Emoji: 😀 🚀", greedy(N)),
        ("Hello, world!", sampled(5, temperature=2.0, seed=7)),  # same seed, other prompt
        ("Café, crème brûlée", sampled(16, top_k=1, seed=99)),
        ("Привет, мир!", sampled(24, min_p=0.2, top_p=0.7, top_k=3)),
        (TARGET_PROMPT, target_params()),
    ]
    for batch in (batch_a, batch_b):
        outs = llm.generate([p for p, _ in batch], [sp for _, sp in batch], use_tqdm=False)
        for (prompt, sp), out in zip(batch, outs):
            assert len(out["token_ids"]) == sp.max_tokens
            if prompt == TARGET_PROMPT:
                assert out["token_ids"] == alone["token_ids"], "a seeded request changed with its batch"
                assert out["text"] == alone["text"]
            elif sp.greedy:
                assert out["token_ids"] == refs[prompt]["token_ids"], "a greedy row changed in a mixed batch"

    # The same request twice in one batch, and the target after a long prompt in the same step.
    outs = llm.generate([TARGET_PROMPT, "x" * 200, TARGET_PROMPT],
                        [target_params(), sampled(8, seed=1), target_params()], use_tqdm=False)
    assert outs[0]["token_ids"] == alone["token_ids"]
    assert outs[2]["token_ids"] == alone["token_ids"]
    assert_idle(llm)


def test_different_seeds_differ(llm):
    outs = llm.generate([TARGET_PROMPT] * 4, [target_params(seed=s) for s in (7, 8, 9, 10**12)], use_tqdm=False)
    seqs = [tuple(o["token_ids"]) for o in outs]
    assert len(set(seqs)) == 4, f"different seeds gave identical outputs: {seqs}"
    alone = llm.generate([TARGET_PROMPT], target_params(seed=7), use_tqdm=False)[0]
    assert outs[0]["token_ids"] == alone["token_ids"]


def test_seeded_request_independent_of_engine_seed_chunking_and_preemption(ckpt, llm):
    alone = llm.generate([TARGET_PROMPT], target_params(), use_tqdm=False)[0]["token_ids"]
    # Another engine seed does not matter for a request with its own seed.
    other = make_llm(ckpt, seed=12345)
    assert other.generate([TARGET_PROMPT], target_params(), use_tqdm=False)[0]["token_ids"] == alone

    # Chunked prefill (8 tokens a step) and preemption (a KV cache of 6 blocks of 16 tokens for
    # 4 requests of about 40 tokens each): the seeded request still gives the same tokens.
    tight = make_llm(ckpt, max_num_batched_tokens=8, num_kvcache_blocks=6)
    prompts = ["Hello, world! How are you", TARGET_PROMPT, "The capital of France is", "def add(a, b):"]
    params = [sampled(24, seed=1), target_params(), sampled(24), greedy(24)]
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.scheduler.num_preemptions > 0, "the test meant to force preemption but none happened"
    assert outs[1]["token_ids"] == alone
    assert outs[3]["token_ids"] == llm.generate(["def add(a, b):"], greedy(24), use_tqdm=False)[0]["token_ids"]
    # Request 0 (seeded) is reproducible under preemption too.
    assert outs[0]["token_ids"] == llm.generate([prompts[0]], sampled(24, seed=1), use_tqdm=False)[0]["token_ids"]
    assert_idle(tight)


UNSEEDED_BATCH = [
    ("Hello, world!", dict(temperature=0.8, top_k=40)),
    ("The capital of France is", dict(temperature=1.0)),
    ("def add(a, b):", dict(temperature=0.9, top_p=0.9)),
    ("你好", dict(temperature=1.2, min_p=0.05)),
    ("The capital of France is", dict(temperature=0.0)),  # greedy row in the middle
    ("Hello, world!", dict(temperature=0.8, top_k=40)),  # same request as row 0: its own random stream
]


def run_unseeded(llm):
    prompts = [p for p, _ in UNSEEDED_BATCH]
    params = [SamplingParams(max_tokens=16, ignore_eos=True, **kw) for _, kw in UNSEEDED_BATCH]
    return ids_of(llm.generate(prompts, params, use_tqdm=False))


def test_engine_seed_makes_runs_reproducible(ckpt, refs):
    a, b, c = make_llm(ckpt, seed=1), make_llm(ckpt, seed=1), make_llm(ckpt, seed=2)
    a1, a2 = run_unseeded(a), run_unseeded(a)
    b1, b2 = run_unseeded(b), run_unseeded(b)
    c1 = run_unseeded(c)
    # Whole runs (several generate calls) are reproducible with the same engine seed.
    assert a1 == b1 and a2 == b2
    # Each request draws its own randomness: a repeated request, or a second call, differs.
    assert a1[0] != a1[5], "two unseeded requests in one batch got the same random stream"
    assert a1 != a2, "a second generate call repeated the first one's random draws"
    # Another engine seed gives other outputs.
    assert a1 != c1
    sampled_rows = [i for i, (_, kw) in enumerate(UNSEEDED_BATCH) if kw["temperature"] > 0]
    assert any(a1[i] != c1[i] for i in sampled_rows)
    # The greedy row is the same everywhere.
    greedy_ref = refs["The capital of France is"]["token_ids"][:16]
    assert a1[4] == a2[4] == c1[4] == greedy_ref


def test_filters_that_keep_one_token_are_greedy(llm, refs):
    prompt = "Hello, world!"
    params = [
        sampled(N, temperature=1.5, top_k=1, seed=1),
        sampled(N, temperature=2.0, top_p=1e-6, seed=2),
        sampled(N, temperature=3.0, min_p=1.0, seed=3),
        sampled(N, temperature=1.0, top_k=1, top_p=0.5, min_p=0.5),  # unseeded
        greedy(N),
        sampled(N, temperature=1.0, seed=4),  # a real sampling row alongside
    ]
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    ref = refs[prompt]["token_ids"]
    for i in range(5):
        assert outs[i]["token_ids"] == ref, f"row {i}: a filter keeping only the top token did not give greedy"
    assert outs[5]["token_ids"] != ref


def test_filters_switched_off_change_nothing(llm):
    # top_k=-1, top_k=0 and a top_k above the vocabulary size are all "off"; top_p=1 and
    # min_p=0 too: the same seed gives the same tokens, in batches that sort and ones that don't.
    prompt = "Hello, world!"
    params = [sampled(N, seed=4), sampled(N, seed=4, top_k=0), sampled(N, seed=4, top_k=10**9),
              sampled(N, seed=4, top_p=1.0, min_p=0.0), sampled(N, seed=4, top_k=-1)]
    outs = llm.generate([prompt] * 5 + ["你好"], params + [sampled(N, seed=1, top_p=0.3)], use_tqdm=False)
    assert all(o["token_ids"] == outs[0]["token_ids"] for o in outs[:5])
    alone = llm.generate([prompt], sampled(N, seed=4, top_k=10**9), use_tqdm=False)[0]
    assert alone["token_ids"] == outs[0]["token_ids"]


def allowed_first_tokens(logits, temperature, top_k=-1, top_p=1.0, min_p=0.0, slack=1e-4):
    """The tokens (and their renormalised probabilities) a filtered sampler may draw, from fp32
    logits [V]; `slack` keeps borderline tokens in (the engine's logits differ by ~1e-6)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = torch.argsort(probs, descending=True)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k > 0:
        keep[order[top_k:]] = False
    p = torch.where(keep, probs, 0.0)
    p = p / p.sum()
    if top_p < 1.0:
        sorted_p = p[order]
        before = torch.cumsum(sorted_p, 0) - sorted_p  # mass before each token
        drop = before >= top_p + slack
        keep[order[drop]] = False
    if min_p > 0.0:
        keep &= probs >= (min_p - slack) * probs.max()
    q = torch.where(keep, probs, 0.0)
    return keep, q / q.sum()


def test_sampled_first_token_distribution(ckpt):
    """Many seeds, one step: tokens come only from the filtered set, with its probabilities."""
    from helpers import hf_logits

    engine = make_llm(ckpt, num_kvcache_blocks=256, max_num_seqs=256)
    prompt_ids = engine.tokenizer.encode("Hello, world!")
    logits = hf_logits(ckpt, prompt_ids)[-1]
    n = 240
    groups = [
        dict(temperature=0.7),
        dict(temperature=1.5),
        dict(temperature=1.0, top_k=3),
        dict(temperature=1.2, top_p=0.5),
        dict(temperature=1.5, min_p=0.2),
        dict(temperature=2.0, top_k=8, top_p=0.8, min_p=0.05),
    ]
    params = [SamplingParams(max_tokens=1, ignore_eos=True, seed=1000 * g + i, **kw)
              for g, kw in enumerate(groups) for i in range(n)]
    outs = engine.generate([prompt_ids] * len(params), params, use_tqdm=False)
    for g, kw in enumerate(groups):
        got = torch.tensor([o["token_ids"][0] for o in outs[g * n:(g + 1) * n]])
        keep, q = allowed_first_tokens(logits, **kw)
        bad = [t for t in got.tolist() if not keep[t]]
        assert not bad, f"{kw}: sampled tokens outside the filtered set: {sorted(set(bad))}"
        counts = torch.bincount(got, minlength=logits.numel()).double()
        for t in torch.nonzero(q > 0.03).flatten().tolist():
            p = q[t].item()
            sigma = (p * (1 - p) / n) ** 0.5
            assert abs(counts[t].item() / n - p) <= 5 * sigma + 1e-9, \
                f"{kw}: token {t} drawn {counts[t].item() / n:.3f} of the time, expected {p:.3f}"
        assert len(set(got.tolist())) > 1 or q.max() > 0.99
    assert_idle(engine)


# ============================================================================================
# 2. stop_token_ids, min_tokens, ignore_eos, max_tokens
# ============================================================================================


def test_stop_token_ids_stop_at_first_occurrence(llm, refs):
    # A token occurring at least twice in a greedy continuation (EOS ignored throughout).
    case = None
    for prompt, out in refs.items():
        ids = out["token_ids"]
        for f, t in enumerate(ids):
            if f >= 1 and ids.count(t) >= 2 and t not in ids[:f]:
                case = (prompt, ids, f, t)
                break
        if case:
            break
    assert case, "no greedy reference repeats a token"
    prompt, ids, f, t = case
    out = llm.generate([prompt], greedy(N, stop_token_ids=[t]), use_tqdm=False)[0]
    assert out["token_ids"] == ids[:f + 1]
    assert out["token_ids"][-1] == t
    assert out["finish_reason"] == "stop"

    # Several stop ids: the earliest produced wins, whatever the list order.
    later = next(x for x in ids[f + 1:] if x not in ids[:f + 1])
    out = llm.generate([prompt], greedy(N, stop_token_ids=[later, t]), use_tqdm=False)[0]
    assert out["token_ids"] == ids[:f + 1] and out["finish_reason"] == "stop"

    # A stop id that is the very first token: one token (sampled in the prefill step).
    out = llm.generate([prompt], greedy(N, stop_token_ids=[ids[0]]), use_tqdm=False)[0]
    assert out["token_ids"] == ids[:1] and out["finish_reason"] == "stop"

    # A stop id never produced: runs to max_tokens.
    never = next(x for x in range(BPE_VOCAB) if x not in ids)
    out = llm.generate([prompt], greedy(N, stop_token_ids=[never]), use_tqdm=False)[0]
    assert out["token_ids"] == ids and out["finish_reason"] == "length"
    assert_idle(llm)


def test_min_tokens_suppresses_stop_ids(llm, refs):
    prompt, ids, k = find_fresh_token_case(refs)
    t = ids[k]
    # min_tokens=0 and min_tokens=k (token k is the (k+1)-th, so it may stop there): stops at k.
    for m in (0, 1, k):
        out = llm.generate([prompt], greedy(N, stop_token_ids=[t], min_tokens=m), use_tqdm=False)[0]
        assert out["token_ids"] == ids[:k + 1] and out["finish_reason"] == "stop", f"min_tokens={m}"
    # min_tokens > k: token k is suppressed, generation goes on at least to min_tokens.
    for m in (k + 1, k + 4, N):
        out = llm.generate([prompt], greedy(N, stop_token_ids=[t], min_tokens=m), use_tqdm=False)[0]
        got = out["token_ids"]
        assert got[:k] == ids[:k], "suppressing a token that was not the argmax changed earlier steps"
        assert got[k] != t
        assert len(got) >= m, f"min_tokens={m}: stopped after {len(got)} tokens"
        assert t not in got[:m], f"min_tokens={m}: stop id {t} produced at {got.index(t)}"
        if out["finish_reason"] == "stop":
            assert got[-1] == t and t not in got[:-1]
        else:
            assert out["finish_reason"] == "length" and len(got) == N
        assert out["text"] == decode(llm.tokenizer, got)
    # min_tokens == max_tokens: never stops early.
    out = llm.generate([prompt], greedy(k + 2, stop_token_ids=[t], min_tokens=k + 2), use_tqdm=False)[0]
    assert len(out["token_ids"]) == k + 2 and out["finish_reason"] == "length"
    assert t not in out["token_ids"]
    assert_idle(llm)


def test_min_tokens_in_a_mixed_batch(llm, refs):
    # Suppression is per request: the same prompt without min_tokens still stops at k.
    prompt, ids, k = find_fresh_token_case(refs)
    t = ids[k]
    params = [greedy(N, stop_token_ids=[t], min_tokens=k + 3), greedy(N, stop_token_ids=[t]), greedy(N),
              target_params()]
    outs = llm.generate([prompt, prompt, prompt, TARGET_PROMPT], params, use_tqdm=False)
    assert t not in outs[0]["token_ids"][:k + 3] and len(outs[0]["token_ids"]) >= k + 3
    assert outs[1]["token_ids"] == ids[:k + 1] and outs[1]["finish_reason"] == "stop"
    assert outs[2]["token_ids"] == ids and outs[2]["finish_reason"] == "length"
    alone = llm.generate([TARGET_PROMPT], target_params(), use_tqdm=False)[0]
    assert outs[3]["token_ids"] == alone["token_ids"]


def test_max_tokens_gives_length(llm, refs):
    prompt = "Hello, world!"
    ids = refs[prompt]["token_ids"]
    for n in (1, 2, 7, N):
        out = llm.generate([prompt], greedy(n), use_tqdm=False)[0]
        assert out["token_ids"] == ids[:n] and out["finish_reason"] == "length"
    # Sampled requests also produce exactly max_tokens tokens.
    outs = llm.generate([prompt] * 3, [sampled(n, seed=n) for n in (1, 5, 13)], use_tqdm=False)
    assert [len(o["token_ids"]) for o in outs] == [1, 5, 13]
    assert all(o["finish_reason"] == "length" for o in outs)


# ============================================================================================
# 6. EOS ids from generation_config.json and from the tokenizer
# ============================================================================================


@pytest.fixture(scope="module")
def eos_case(refs):
    return find_fresh_token_case(refs)


@pytest.fixture(scope="module")
def eos_llm(ckpt, eos_case, tmp_path_factory):
    """The checkpoint with generation_config.json's eos_token_id extended by greedy token k."""
    _, ids, k = eos_case
    folder = copy_checkpoint(ckpt, tmp_path_factory.mktemp("gen_eos") / "ckpt")
    edit_json(os.path.join(folder, "generation_config.json"),
              lambda c: c.update(eos_token_id=list(EOS_IDS) + [ids[k]]))
    return make_llm(folder)


def test_eos_from_generation_config(eos_llm, eos_case):
    prompt, ids, k = eos_case
    t = ids[k]
    assert t not in EOS_IDS
    out = eos_llm.generate([prompt], greedy(N, ignore_eos=False), use_tqdm=False)[0]
    assert out["token_ids"] == ids[:k + 1] and out["finish_reason"] == "stop"
    # The default SamplingParams honour EOS too.
    out = eos_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=N), use_tqdm=False)[0]
    assert out["token_ids"] == ids[:k + 1] and out["finish_reason"] == "stop"
    # ignore_eos: continues past it to max_tokens.
    out = eos_llm.generate([prompt], greedy(N, ignore_eos=True), use_tqdm=False)[0]
    assert out["token_ids"] == ids and out["finish_reason"] == "length"
    # max_tokens reached first.
    out = eos_llm.generate([prompt], greedy(k, ignore_eos=False), use_tqdm=False)[0]
    assert out["token_ids"] == ids[:k] and out["finish_reason"] == "length"
    assert_idle(eos_llm)


def test_min_tokens_suppresses_eos(eos_llm, eos_case):
    prompt, ids, k = eos_case
    t = ids[k]
    out = eos_llm.generate([prompt], greedy(N, ignore_eos=False, min_tokens=k), use_tqdm=False)[0]
    assert out["token_ids"] == ids[:k + 1] and out["finish_reason"] == "stop"
    for m in (k + 1, k + 5):
        out = eos_llm.generate([prompt], greedy(N, ignore_eos=False, min_tokens=m), use_tqdm=False)[0]
        got = out["token_ids"]
        assert got[:k] == ids[:k] and got[k] != t
        assert len(got) >= m
        eos = set(EOS_IDS) | {t}
        assert not eos & set(got[:m]), f"min_tokens={m}: an EOS id was produced before min_tokens: {got}"
        if out["finish_reason"] == "stop":
            assert got[-1] in eos and not eos & set(got[:-1])
        else:
            assert len(got) == N
    # Sampled rows: EOS suppressed until min_tokens as well.
    outs = eos_llm.generate([prompt] * 6, [sampled(N, ignore_eos=False, min_tokens=12, seed=s) for s in range(6)],
                            use_tqdm=False)
    eos = set(EOS_IDS) | {t}
    for o in outs:
        assert len(o["token_ids"]) >= 12 and not eos & set(o["token_ids"][:12])
    assert_idle(eos_llm)


def test_eos_from_the_tokenizer(ckpt, tok, refs, tmp_path):
    # Make an ordinary token the tokenizer's EOS (and only the tokenizer's).
    prompt, ids, k = find_fresh_token_case(refs)
    t = ids[k]
    folder = copy_checkpoint(ckpt, tmp_path / "tok_eos")
    from transformers import AutoTokenizer

    piece = tok.convert_ids_to_tokens(t)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if os.path.isfile(os.path.join(folder, name)):
            edit_json(os.path.join(folder, name), lambda c: c.update(eos_token=piece))
    assert AutoTokenizer.from_pretrained(folder).eos_token_id == t, "could not set the tokenizer's EOS"
    llm = make_llm(folder)
    # The edited tokenizer treats the EOS piece as special: give the prompt as the original ids.
    out = llm.generate([tok.encode(prompt)], greedy(N, ignore_eos=False), use_tqdm=False)[0]
    assert out["token_ids"] == ids[:k + 1] and out["finish_reason"] == "stop"
    out = llm.generate([tok.encode(prompt)], greedy(N, ignore_eos=True), use_tqdm=False)[0]
    assert out["token_ids"] == ids and out["finish_reason"] == "length"


# ============================================================================================
# 3. Stop strings
# ============================================================================================


def clean(piece: str) -> bool:
    return FFFD not in piece


def boundary_cases(tok, refs, min_len=2):
    """(prompt, i, s, start): a stop string s that starts strictly inside greedy token i and ends
    strictly inside token i+1 (both clean ordinary tokens), first occurring at `start` of the text.
    At most one case per prompt."""
    cases = []
    for prompt, out in refs.items():
        ids = out["token_ids"]
        full = decode(tok, ids)
        pieces = [decode(tok, [t]) for t in ids]
        for i in range(len(ids) - 1):
            a, b = pieces[i], pieces[i + 1]
            if not (ids[i] < BPE_VOCAB and ids[i + 1] < BPE_VOCAB and clean(a) and clean(b)
                    and len(a) >= min_len and len(b) >= min_len):
                continue
            prefix = decode(tok, ids[:i + 1])
            if not (full.startswith(prefix) and prefix.endswith(a)):
                continue
            s = a[1:] + b[:-1]  # strictly inside both tokens
            start = len(prefix) - len(a) + 1
            if full.find(s) == start:  # (not occurring earlier)
                cases.append((prompt, i, s, start))
                break
    return cases


def test_stop_string_across_token_boundary(llm, tok, refs):
    """A stop string starting inside token i and ending inside token i+1."""
    cases = boundary_cases(tok, refs)
    assert cases, "no greedy text has two adjacent clean multi-character tokens"
    for prompt, i, s, start in cases[:4]:
        ids = refs[prompt]["token_ids"]
        full = decode(tok, ids)
        assert full == refs[prompt]["text"]
        res = llm.generate([prompt], greedy(N, stop=[s]), use_tqdm=False)[0]
        assert res["finish_reason"] == "stop", (prompt, s)
        assert res["text"] == full[:start], (prompt, s)
        assert res["token_ids"] == ids[:i + 2], "generation did not end at the token completing the stop string"
    assert_idle(llm)


def test_stop_strings_completed_by_the_same_token(llm, tok, refs):
    """Two stop strings both completed by token i+1: the one occurring first in the text wins,
    whatever the order they are listed in (not the first or the last listed)."""
    done = 0
    for prompt, i, s_long, start in boundary_cases(tok, refs, min_len=3):
        ids = refs[prompt]["token_ids"]
        full = decode(tok, ids)
        b = decode(tok, [ids[i + 1]])
        s_short = b[:-1]  # starts at token i+1, after s_long's start
        if full.find(s_short) != len(decode(tok, ids[:i + 1])) or s_short in s_long[:-1]:
            continue
        for stops in ([s_long, s_short], [s_short, s_long]):
            res = llm.generate([prompt], greedy(N, stop=stops), use_tqdm=False)[0]
            assert res["finish_reason"] == "stop"
            assert res["text"] == full[:start], (stops, res["text"])
            assert res["token_ids"] == ids[:i + 2]
        done += 1
    assert done, "no case of two stop strings completed by one token"


def test_stop_string_at_the_start_and_at_the_end(llm, tok, refs):
    prompt = next(p for p, o in refs.items() if clean(decode(tok, o["token_ids"][:1]))
                  and len(decode(tok, o["token_ids"][:1])) >= 1)
    ids = refs[prompt]["token_ids"]
    full = decode(tok, ids)
    # The first character: empty text, one token.
    res = llm.generate([prompt], greedy(N, stop=full[0]), use_tqdm=False)[0]
    assert res["text"] == "" and res["token_ids"] == ids[:1] and res["finish_reason"] == "stop"
    # The whole greedy text of the first 10 tokens as stop string.
    ten = decode(tok, ids[:10])
    if FFFD not in ten:
        expected = stop_point(tok, ids, [ten])
        res = llm.generate([prompt], greedy(N, stop=ten), use_tqdm=False)[0]
        assert res["finish_reason"] == "stop"
        assert (len(res["token_ids"]), res["text"]) == expected
        assert res["text"] == full[:full.find(ten)]


def test_stop_string_multibyte(llm, tok, refs):
    """Stop strings of non-ASCII characters, within one token or spread over several byte tokens."""
    within = spread = None
    for prompt, out in refs.items():
        ids = out["token_ids"]
        full = decode(tok, ids)
        pieces = [decode(tok, [t]) for t in ids]
        for c in full:
            if ord(c) < 128 or c == FFFD:
                continue
            if any(c in p for p in pieces):
                within = within or (prompt, c)
            else:
                spread = spread or (prompt, c)
    cases = [x for x in (within, spread) if x]
    assert cases, "the greedy texts contain no non-ASCII character at all"
    for prompt, c in cases:
        ids = refs[prompt]["token_ids"]
        full = decode(tok, ids)
        for s in {c, full[full.find(c):full.find(c) + 2]}:
            if FFFD in s:
                continue
            expected = stop_point(tok, ids, [s])
            res = llm.generate([prompt], greedy(N, stop=[s]), use_tqdm=False)[0]
            assert res["finish_reason"] == "stop", (prompt, s)
            assert res["text"] == full[:full.find(s)], (prompt, s)
            assert res["token_ids"] == ids[:expected[0]], (prompt, s)
            assert s in decode(tok, res["token_ids"])
    assert_idle(llm)


def clean_substrings(tok, ids, min_len=2):
    """(position in the full text, substring) of clean multi-character single-token pieces, in order."""
    full = decode(tok, ids)
    out = []
    for i, t in enumerate(ids):
        p = decode(tok, [t])
        if t < BPE_VOCAB and clean(p) and len(p) >= min_len and full.find(p) >= 0:
            out.append((full.find(p), p))
    return sorted(set(out))


def test_earliest_of_several_stop_strings_wins(llm, tok, refs):
    done = 0
    for prompt, out in refs.items():
        ids = out["token_ids"]
        full = decode(tok, ids)
        subs = clean_substrings(tok, ids)
        subs = [(pos, s) for pos, s in subs if pos > 0]
        if len(subs) < 2:
            continue
        (p_early, early), (p_late, late) = subs[0], subs[-1]
        if p_early == p_late or early in late or late in early:
            continue
        for stops in ([late, early], [early, late]):
            res = llm.generate([prompt], greedy(N, stop=stops), use_tqdm=False)[0]
            assert res["finish_reason"] == "stop"
            assert res["text"] == full[:p_early], (stops, res["text"], full)
            assert (len(res["token_ids"]), res["text"]) == stop_point(tok, ids, stops)
        res = llm.generate([prompt], greedy(N, stop=[late]), use_tqdm=False)[0]
        assert res["text"] == full[:p_late] and res["finish_reason"] == "stop"
        done += 1
        if done == 2:
            break
    assert done, "no greedy text has two distinct clean pieces"


def test_stop_string_never_produced(llm, tok, refs):
    prompt = "def add(a, b):"
    out = refs[prompt]
    never = "NEVER-PRODUCED-STOP-STRING"
    assert never not in out["text"]
    res = llm.generate([prompt], greedy(N, stop=[never, "\x00\x01\x02"]), use_tqdm=False)[0]
    assert res["token_ids"] == out["token_ids"]
    assert res["text"] == out["text"] == decode(tok, out["token_ids"])
    assert res["finish_reason"] == "length"


def test_stop_strings_match_generated_text_only(llm, tok, refs):
    # The prompt's own text, or a string straddling prompt and output, does not stop generation.
    prompt = "SELECT id, name FROM users"
    out = refs[prompt]
    full = out["text"]
    straddle = prompt[-3:] + full[:2]
    stops = [s for s in (prompt, prompt[-4:], straddle) if s not in full]
    assert stops
    res = llm.generate([prompt], greedy(N, stop=stops), use_tqdm=False)[0]
    assert res["token_ids"] == out["token_ids"] and res["text"] == full and res["finish_reason"] == "length"


def test_stop_strings_per_request_in_a_batch(llm, tok, refs):
    prompts = ["Hello, world!", "The capital of France is", "Hello, world!"]
    ids = refs["Hello, world!"]["token_ids"]
    subs = clean_substrings(tok, ids)
    assert subs
    pos, s = subs[len(subs) // 2]
    params = [greedy(N, stop=s), greedy(N, stop=s), greedy(N)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert (len(outs[0]["token_ids"]), outs[0]["text"]) == stop_point(tok, ids, [s])
    assert outs[0]["finish_reason"] == "stop"
    other = refs["The capital of France is"]
    exp = stop_point(tok, other["token_ids"], [s])
    if exp is None:
        assert outs[1]["token_ids"] == other["token_ids"] and outs[1]["finish_reason"] == "length"
    else:
        assert (len(outs[1]["token_ids"]), outs[1]["text"]) == exp
    assert outs[2]["token_ids"] == ids and outs[2]["text"] == refs["Hello, world!"]["text"]


# ============================================================================================
# 4. Streaming
# ============================================================================================


def stream_batch(tok, refs):
    """Mixed requests: greedy, seeded sampling, stop strings (ASCII and multi-byte), stop ids,
    max_tokens=1, min_tokens."""
    r = {p: o["token_ids"] for p, o in refs.items()}
    subs = clean_substrings(tok, r["Hello, world!"])
    mid_stop = subs[len(subs) // 2][1]
    texts = {p: decode(tok, ids) for p, ids in r.items()}
    mb = next(((p, c) for p, t in texts.items() for c in t if ord(c) > 127 and c != FFFD), None)
    _, ids_f, k = find_fresh_token_case(refs)
    batch = [
        ("Hello, world!", greedy(N)),
        ("Once upon a time", target_params()),
        ("Hello, world!", greedy(N, stop=[mid_stop])),
        ("def add(a, b):", greedy(N, stop_token_ids=[r["def add(a, b):"][5]])),
        ("你好", greedy(1)),
        ("Emoji: 😀 🚀", sampled(30, temperature=1.0, top_p=0.95, min_p=0.02, seed=5, stop=["。"])),
        ("The capital of France is", sampled(N, seed=11, top_k=20, min_tokens=10, stop_token_ids=[ids_f[k]])),
        ("Café, crème brûlée", greedy(N)),
        ("Привет, мир!", sampled(7, temperature=1.5, seed=3)),
        ("SELECT id, name FROM users", greedy(N, stop=["NEVER", "zzz"])),
    ]
    if mb:
        batch.append((mb[0], greedy(N, stop=[mb[1]])))
    # Stop strings spanning a token boundary: their first part must be held back, never shown.
    for prompt, _, s, _ in boundary_cases(tok, refs)[:3]:
        batch.append((prompt, greedy(N, stop=["zzz", s])))
    return batch


def test_stream_equals_generate(llm, tok, refs):
    batch = stream_batch(tok, refs)
    prompts = [p for p, _ in batch]
    params = [sp for _, sp in batch]
    expected = llm.generate(prompts, params, use_tqdm=False)
    assert any(o["finish_reason"] == "stop" for o in expected)
    assert expected[2]["finish_reason"] == "stop"  # the mid-text stop string was hit

    incs = list(llm.stream(prompts, params))
    assert incs, "stream yielded nothing"
    per = {i: [] for i in range(len(prompts))}
    for inc in incs:
        assert 0 <= inc.index < len(prompts)
        assert isinstance(inc.token_ids, list) and all(type(t) is int for t in inc.token_ids)
        assert isinstance(inc.text, str)
        per[inc.index].append(inc)
    for i, exp in enumerate(expected):
        got = per[i]
        assert got, f"request {i} got no increment"
        tokens = [t for inc in got for t in inc.token_ids]
        text = "".join(inc.text for inc in got)
        assert tokens == exp["token_ids"], f"request {i}: streamed tokens differ from generate()"
        assert text == exp["text"], f"request {i}: streamed text {text!r} != generate() text {exp['text']!r}"
        finished = [j for j, inc in enumerate(got) if inc.finished]
        assert finished == [len(got) - 1], f"request {i}: finished flags {[inc.finished for inc in got]}"
        assert got[-1].finish_reason == exp["finish_reason"]
        assert all(inc.finish_reason is None for inc in got[:-1])
        # No broken character is ever shown: no increment holds U+FFFD unless the final text does,
        # and no increment but the last ends with one (it may be an incomplete character).
        if FFFD not in exp["text"]:
            assert not any(FFFD in inc.text for inc in got), f"request {i} streamed a broken character"
        assert not any(inc.text.endswith(FFFD) for inc in got[:-1]), f"request {i}: increment ends in U+FFFD"
    # A stop string is never shown, not even its start (the part in an earlier token).
    for i, sp in enumerate(params):
        shown = ""
        for inc in per[i]:
            shown += inc.text
            assert expected[i]["text"].startswith(shown), f"request {i} showed text later withdrawn: {shown!r}"
            assert not any(s in shown for s in sp.stop_strings)
    assert_idle(llm)
    assert not llm.requests._detok, "detokenizer state left behind after streaming"


@pytest.fixture(scope="module")
def wordpiece_llm(tmp_path_factory):
    """A tiny model with a word-level tokenizer (w0 w1 ...) whose WordPiece decoder joins tokens
    with spaces: a decode of the output alone has no leading space, the continuation does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    import tiny_model as tm

    folder = tmp_path_factory.mktemp("wordpiece")
    tm.make_tiny_qwen3(folder, with_tokenizer=False)
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(tm.TOKENIZER_VOCAB_SIZE - 1)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.decoder = decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]").save_pretrained(str(folder))
    engine = make_llm(str(folder))
    yield engine
    engine.shutdown()


def test_text_is_the_same_by_every_path_and_continues_the_prompt(wordpiece_llm):
    """generate(), generate() with a stop string and the concatenated stream() increments give
    one text: the output as it continues the prompt, leading space included (vLLM's convention).
    Before: generate() gave 'w161 w66 ...' and the other two ' w161 w66 ...'."""
    llm = wordpiece_llm
    prompt = "w5 w6 w7"
    plain = llm.generate([prompt], greedy(6), use_tqdm=False)[0]
    with_stop = llm.generate([prompt], greedy(6, stop=["no such words"]), use_tqdm=False)[0]
    streamed = "".join(inc.text for inc in llm.stream([prompt], greedy(6)))
    assert plain["token_ids"] == with_stop["token_ids"]
    assert plain["text"] == with_stop["text"] == streamed
    assert plain["text"].startswith(" ")
    ids = plain["prompt_token_ids"] + plain["token_ids"]
    assert llm.tokenizer.decode(ids) == llm.tokenizer.decode(plain["prompt_token_ids"]) + plain["text"]
    assert_idle(llm)


def test_stream_single_prompt_and_default_params(llm, refs):
    prompt = "Hello, world!"
    incs = list(llm.stream(prompt, greedy(12)))
    assert {inc.index for inc in incs} == {0}
    assert [t for inc in incs for t in inc.token_ids] == refs[prompt]["token_ids"][:12]
    assert sum(inc.finished for inc in incs) == 1 and incs[-1].finished
    assert incs[-1].finish_reason == "length"
    assert "".join(inc.text for inc in incs) == decode(llm.tokenizer, refs[prompt]["token_ids"][:12])


def test_stream_multibyte_text_is_held_until_complete(llm, tok, refs):
    """A request whose text has characters spread over several byte tokens: every increment is
    valid text, and the increments add up to generate()'s text."""
    prompt = max(refs, key=lambda p: sum(1 for t in refs[p]["token_ids"] if FFFD in decode(tok, [t])))
    ids = refs[prompt]["token_ids"]
    incs = list(llm.stream([prompt], greedy(N)))
    texts = [inc.text for inc in incs]
    assert "".join(texts) == decode(tok, ids)
    # Every prefix of the concatenated increments is a prefix of the final text.
    final = decode(tok, ids)
    acc = ""
    for inc in incs[:-1]:
        acc += inc.text
        assert final.startswith(acc)
        assert not acc.endswith(FFFD)
    # Increments with no new stable text are empty strings, never partial characters.
    assert any(t == "" for t in texts) or all(FFFD not in decode(tok, [t]) for t in ids)


def test_stream_early_close_leaves_engine_idle(llm, refs):
    prompts = ["Hello, world!", "The capital of France is", "Once upon a time", "你好"]
    params = [greedy(N), target_params(max_tokens=N), greedy(N, stop=["zzz"]), greedy(N)]
    # Explicit close after a few increments.
    it = llm.stream(prompts, params)
    got = [next(it) for _ in range(6)]
    assert all(not inc.finished for inc in got)
    it.close()
    assert_idle(llm)
    assert not llm.requests._detok, "detokenizer state left behind by a closed stream"
    # break out of a for loop (the generator is closed when it is dropped).
    n = 0
    for _ in llm.stream(prompts, params):
        n += 1
        if n == 9:
            break
    assert_idle(llm)
    # A stream closed before its first increment never started anything.
    it = llm.stream(prompts, params)
    it.close()
    assert_idle(llm)
    # The engine still works, with the same results as before.
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[0]["token_ids"] == refs[prompts[0]]["token_ids"]
    assert outs[2]["token_ids"] == refs[prompts[2]]["token_ids"]
    assert outs[3]["token_ids"] == refs[prompts[3]]["token_ids"]
    alone = llm.generate([prompts[1]], target_params(max_tokens=N), use_tqdm=False)[0]
    assert outs[1]["token_ids"] == alone["token_ids"]
    incs = list(llm.stream(prompts, params))
    for i, o in enumerate(outs):
        assert [t for inc in incs if inc.index == i for t in inc.token_ids] == o["token_ids"]
    assert_idle(llm)


def test_stream_closed_while_a_final_token_is_in_flight_forgets_its_text(llm, refs):
    """Overlap scheduling ends a max_tokens request when its last step is launched, before the
    token reaches the host: closing the stream right then must still drop its text state."""
    prompts = ["Hello, world!", "The capital of France is"]
    it = llm.stream(prompts, [greedy(2), greedy(20)])
    for inc in it:
        if inc.index == 0:
            assert not inc.finished  # request 0's second and last token is still in flight
            break
    it.close()
    assert_idle(llm)
    assert not llm.requests._detok and not llm.requests._streamed, "detokenizer state left behind by a closed stream"
    assert llm.generate(prompts[:1], greedy(2), use_tqdm=False)[0]["token_ids"] == \
        refs[prompts[0]]["token_ids"][:2]


class _InterruptedWait:
    """Pending tokens whose wait is interrupted (Ctrl-C while the host waits for the device)."""

    def result(self):
        raise KeyboardInterrupt


def interrupt_launch(llm, monkeypatch, n: int, where: str) -> list:
    """Make the n-th launch from now fail: `where` = "launch" raises KeyboardInterrupt inside it,
    "wait" launches and hands back tokens whose wait raises. Returns the batches launched (the
    n-th included when it was launched); `monkeypatch.undo()` restores the runner."""
    real = llm.model_runner.launch
    launches = []

    def launch(*args, **kwargs):
        if len(launches) + 1 == n and where == "launch":
            raise KeyboardInterrupt
        pending = real(*args, **kwargs)
        launches.append(args[0])
        return _InterruptedWait() if len(launches) == n else pending

    monkeypatch.setattr(llm.model_runner, "launch", launch)
    return launches


def test_generate_interrupted_mid_run_leaves_no_state_and_engine_usable(llm, refs, monkeypatch):
    prompts = ["Hello, world!", "Once upon a time"]
    params = [greedy(6), greedy(6, stop=["zzz"])]  # a stop string: tracked by a detokenizer
    interrupt_launch(llm, monkeypatch, 3, "launch")
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    assert_idle(llm)
    assert not llm.requests._detok and not llm.requests._streamed
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [refs[p]["token_ids"][:6] for p in prompts]


def test_engine_step_interrupted_while_waiting_aborts_only_the_steps_in_flight(llm, refs, monkeypatch):
    """Engine API: waiting for step n's tokens raises (Ctrl-C) after step n+1 was launched on
    them. The requests of both steps end with "abort"; a running request in neither step goes
    on to the reference tokens, and the engine stays usable."""
    a, c, d = PROMPTS[0], PROMPTS[1], PROMPTS[2]
    launches = interrupt_launch(llm, monkeypatch, 3, "wait")
    seq_a = llm.add_request(llm.tokenize(a), greedy(6))
    llm.step()                                       # launches A's prefill
    llm.step()                                       # launches A's first decode
    seq_c = llm.add_request(llm.tokenize(c), greedy(6))
    llm.step()                                       # launches C's prefill (3rd launch)
    seq_d = llm.add_request(llm.tokenize(d), greedy(6))
    with pytest.raises(KeyboardInterrupt):
        llm.step()                                   # launches D's prefill, then waits for C's
    assert [b.seqs for b in launches[2:]] == [[seq_c], [seq_d]]  # A was in neither step
    assert (seq_c.finish_reason, seq_d.finish_reason) == ("abort", "abort")
    assert not seq_a.is_finished
    monkeypatch.undo()
    while llm.has_unfinished():
        llm.step()
    assert seq_a.completion_token_ids == refs[a]["token_ids"][:6]
    for seq in (seq_a, seq_c, seq_d):
        llm.final_text(seq)
    assert_idle(llm)
    outs = llm.generate([c, d], greedy(6), use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [refs[p]["token_ids"][:6] for p in (c, d)]


@pytest.mark.parametrize("where", ["wait", "launch"])
def test_engine_step_interrupted_between_two_decodes_of_the_same_requests(llm, refs, monkeypatch, where):
    """The usual case: steps n and n+1 decode the same requests, and the wait for n or the launch
    of n+1 (part of which may be queued, over n's tokens on the device) is interrupted. The
    requests end as "abort" with only tokens that arrived, and the engine stays usable."""
    a, b = PROMPTS[0], PROMPTS[3]
    interrupt_launch(llm, monkeypatch, 3 if where == "wait" else 4, where)
    seq_a = llm.add_request(llm.tokenize(a), greedy(8))
    seq_b = llm.add_request(llm.tokenize(b), greedy(8))
    for _ in range(3):
        llm.step()                                   # prefill, decode 1, decode 2 (3rd launch)
    with pytest.raises(KeyboardInterrupt):
        llm.step()                                   # launches decode 3, waits for decode 2
    # "wait": decode 2 never arrives; "launch": decode 3's launch fails with decode 2 in flight.
    for seq, prompt in ((seq_a, a), (seq_b, b)):
        assert seq.finish_reason == "abort"
        assert seq.completion_token_ids == refs[prompt]["token_ids"][:2]  # prefill's and decode 1's
        llm.final_text(seq)
    assert not llm.has_unfinished()
    monkeypatch.undo()
    assert_idle(llm)
    outs = llm.generate([a, b], greedy(8), use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [refs[p]["token_ids"][:8] for p in (a, b)]


def test_engine_step_interrupted_drops_the_unseen_last_token_of_a_finished_request(llm, refs, monkeypatch):
    """A request that ended at launch (max_tokens) but whose last token never arrived ends as
    "abort" without the placeholder token."""
    interrupt_launch(llm, monkeypatch, 1, "wait")
    seq = llm.add_request(llm.tokenize(PROMPTS[0]), greedy(1))
    llm.step()                                       # launches the prefill; ends the request
    assert seq.is_finished and len(seq.completion_token_ids) == 1
    with pytest.raises(KeyboardInterrupt):
        llm.step()                                   # nothing to launch; waits for the prefill
    assert seq.finish_reason == "abort" and seq.completion_token_ids == []
    monkeypatch.undo()
    llm.final_text(seq)
    assert_idle(llm)
    assert llm.generate([PROMPTS[0]], greedy(2), use_tqdm=False)[0]["token_ids"] == refs[PROMPTS[0]]["token_ids"][:2]


def test_abort_of_a_request_finished_at_launch_keeps_its_last_token(llm, refs):
    """Engine API: abort() of a request that already ended (max_tokens reached when its last
    step was launched) is a no-op; the next step still delivers that last token."""
    prompt = "Hello, world!"
    seq = llm.add_request(llm.tokenize(prompt), greedy(1))
    first, _, _ = llm.step()          # launches the prefill; its token is still on the device
    assert first == [] and seq.is_finished
    llm.abort(seq)
    outputs, _, _ = llm.step()        # nothing left to schedule: resolves the launched step
    assert [o.new_token_ids for o in outputs] == [refs[prompt]["token_ids"][:1]]
    assert seq.completion_token_ids == refs[prompt]["token_ids"][:1] and seq.finish_reason == "length"
    assert not llm.has_unfinished()
    llm.final_text(seq)
    assert_idle(llm)


def test_stream_bad_input_raises_and_engine_stays_usable(llm, refs):
    with pytest.raises(ValueError):
        list(llm.stream(["a", "b"], [greedy(3)]))
    with pytest.raises(ValueError):
        list(llm.stream(["Hello"], greedy(10**6)))
    assert_idle(llm)
    out = llm.generate(["Hello, world!"], greedy(5), use_tqdm=False)[0]
    assert out["token_ids"] == refs["Hello, world!"]["token_ids"][:5]


# ============================================================================================
# 5. Chat
# ============================================================================================

CONV = [{"role": "user", "content": "hi"}]
CONV_LONG = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


def chat_ids(tok, conv, **kw):
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True, **kw)
    return text, tok.encode(text, add_special_tokens=False)


def same_output(a, b):
    assert a["token_ids"] == b["token_ids"]
    assert a["text"] == b["text"]
    assert a["finish_reason"] == b["finish_reason"]


def test_chat_equals_generate_on_the_template(llm, tok):
    params = greedy(16)
    text, ids = chat_ids(tok, CONV, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    out = llm.chat(CONV, params, enable_thinking=False, use_tqdm=False)
    assert isinstance(out, list) and len(out) == 1
    same_output(out[0], llm.generate([ids], params, use_tqdm=False)[0])
    if "prompt_token_ids" in out[0]:
        assert out[0]["prompt_token_ids"] == ids
    # Seeded sampling too.
    sp = target_params()
    same_output(llm.chat(CONV, sp, enable_thinking=False, use_tqdm=False)[0],
                llm.generate([ids], sp, use_tqdm=False)[0])
    assert_idle(llm)


def test_chat_enable_thinking(llm, tok):
    params = greedy(16)
    text_off, ids_off = chat_ids(tok, CONV, enable_thinking=False)
    text_on, ids_on = chat_ids(tok, CONV, enable_thinking=True)
    text_default, ids_default = chat_ids(tok, CONV)
    assert text_off != text_on and ids_off != ids_on
    assert "<think>" in text_off and "<think>" not in text_on
    on = llm.chat(CONV, params, enable_thinking=True, use_tqdm=False)[0]
    off = llm.chat(CONV, params, enable_thinking=False, use_tqdm=False)[0]
    default = llm.chat(CONV, params, use_tqdm=False)[0]
    same_output(on, llm.generate([ids_on], params, use_tqdm=False)[0])
    same_output(off, llm.generate([ids_off], params, use_tqdm=False)[0])
    same_output(default, llm.generate([ids_default], params, use_tqdm=False)[0])
    if "prompt_token_ids" in on:
        assert on["prompt_token_ids"] == ids_on and off["prompt_token_ids"] == ids_off


def test_chat_list_of_conversations(llm, tok):
    convs = [CONV, CONV_LONG, [{"role": "user", "content": "你好，世界"}]]
    params = [greedy(12), target_params(max_tokens=12), greedy(12, stop_token_ids=[7])]
    outs = llm.chat(convs, params, enable_thinking=False, use_tqdm=False)
    assert len(outs) == 3
    for conv, sp, out in zip(convs, params, outs):
        _, ids = chat_ids(tok, conv, enable_thinking=False)
        same_output(out, llm.generate([ids], sp, use_tqdm=False)[0])
    # One SamplingParams for all; tuple of conversations.
    outs2 = llm.chat(tuple(convs), greedy(12), enable_thinking=False, use_tqdm=False)
    assert outs2[0]["token_ids"] == outs[0]["token_ids"]
    # A list of one conversation is the same as the conversation.
    assert llm.chat([CONV], greedy(12), enable_thinking=False, use_tqdm=False)[0]["token_ids"] == outs[0]["token_ids"]
    # Mismatched params list length.
    with pytest.raises(ValueError):
        llm.chat(convs, [greedy(3)] * 2, use_tqdm=False)
    assert_idle(llm)


@pytest.mark.parametrize("bad", [
    "hi",
    None,
    5,
    [],
    [[]],
    ["hi"],
    [{"content": "no role"}],
    [{"role": "user", "content": "a"}, "b"],
    [[{"role": "user", "content": "a"}], "b"],
    [[{"role": "user", "content": "a"}], [{"content": "no role"}]],
    [{"role": "user"}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": None}],
    [{"role": "usr", "content": "a typo in the role"}],
    [{"role": "system", "content": "x"}, {"role": "User", "content": "a"}],
], ids=repr)
def test_chat_bad_messages(llm, refs, bad):
    with pytest.raises((TypeError, ValueError)):
        llm.chat(bad, greedy(4), use_tqdm=False)
    assert_idle(llm)
    out = llm.generate(["Hello, world!"], greedy(3), use_tqdm=False)[0]
    assert out["token_ids"] == refs["Hello, world!"]["token_ids"][:3]


def test_chat_message_errors_name_the_message():
    from nanovllm.chat_template import check_conversation as _check_conversation

    with pytest.raises(ValueError, match=r"conversation 1, message 2: role must be one of .*'usr'"):
        _check_conversation([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                             {"role": "usr", "content": "c"}], "conversation 1")
    with pytest.raises(TypeError, match=r"messages, message 0: content must be a string or a list of text parts, got int"):
        _check_conversation([{"role": "user", "content": 5}], "messages")
    with pytest.raises(NotImplementedError, match=r"messages, message 0, part 1: content parts of type 'image_url'"):
        _check_conversation([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                          {"type": "image_url", "image_url": {"url": "x"}}]}], "messages")
    _check_conversation([{"role": "user", "content": [{"type": "text", "text": "a"}]}], "messages")
    # An assistant turn that only calls tools may have no content.
    _check_conversation([{"role": "user", "content": "weather?"},
                         {"role": "assistant", "content": None, "tool_calls": [{"name": "w", "arguments": {}}]},
                         {"role": "tool", "content": "sunny"}], "messages")


@pytest.mark.parametrize("kwargs, name", [
    ({"sampling_param": greedy(3)}, "sampling_param"),  # a typo of sampling_params
    ({"enable_thinkng": False}, "enable_thinkng"),
    ({"tokenize": True}, "tokenize"),
    ({"return_dict": True}, "return_dict"),
])
def test_chat_keyword_arguments_the_template_does_not_read_are_refused(llm, refs, kwargs, name):
    with pytest.raises(TypeError, match=name):
        llm.chat(CONV, greedy(4), use_tqdm=False, **kwargs)
    assert_idle(llm)
    out = llm.generate(["Hello, world!"], greedy(3), use_tqdm=False)[0]
    assert out["token_ids"] == refs["Hello, world!"]["token_ids"][:3]


def test_chat_keyword_error_lists_the_template_variables(llm):
    with pytest.raises(TypeError, match="enable_thinking"):
        llm.chat(CONV, greedy(4), use_tqdm=False, enable_thinkng=False)


def test_stream_rejects_bad_input_at_the_call(llm):
    with pytest.raises(ValueError, match="empty prompt"):
        llm.stream([[]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.stream(["a", "b"], [SamplingParams()])
    assert not llm.scheduler.has_unfinished()


def test_stop_string_in_text_flushed_at_the_end_makes_finish_reason_stop(llm):
    """generate() flushes text held back for an incomplete character when the request ends; a
    stop string found only then ends it with "stop", as stream() reports it."""
    pieces = llm.tokenizer.encode("中", add_special_tokens=False)
    assert len(pieces) > 1  # byte-level pieces: the first alone is an incomplete character
    from nanovllm.core.lifecycle import decide_finish

    seq = llm.add_request(llm.tokenize("Hello, world!"), greedy(1, stop=["\ufffd"]))
    detok = llm.requests._detok[seq.seq_id]
    seq.token_ids.append(pieces[0])  # max_tokens=1 reached right there, inside a character
    # The one finish rule: "length" would end it, the flush finds the stop string first.
    finish = decide_finish(seq, pieces[0], llm.eos_token_ids, llm.config.max_model_len, detok)
    assert finish == ("stop", "\ufffd") and detok.text == ""
    llm.requests.end(seq, *finish)
    assert llm.final_text(seq) == "" and seq.finish_reason == "stop"
    llm.abort(seq)
    assert_idle(llm)


def test_chat_template_given_by_the_caller_is_the_one_checked(llm, tok):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}!{% endif %}"
    out = llm.chat(CONV, greedy(4), use_tqdm=False, chat_template=template, shout=True)[0]
    text = tok.apply_chat_template(CONV, tokenize=False, add_generation_prompt=True, chat_template=template, shout=True)
    assert out["prompt_token_ids"] == tok.encode(text, add_special_tokens=False)
    with pytest.raises(TypeError, match="enable_thinking"):  # this template has no such variable
        llm.chat(CONV, greedy(4), use_tqdm=False, chat_template=template, enable_thinking=False)
