"""The OpenAI-compatible server (`python -m nanovllm.serve`), driven by the official `openai`
client against a server subprocess on 127.0.0.1 (a free port: the server binds port 0 and
prints it) on a tiny random checkpoint (CPU, fp32). One server for the module; the last test
stops it with SIGTERM. What is checked:

1. completions and chat, streaming and not, give exactly the tokens, text and logprobs that the
   offline LLM.generate / LLM.chat give for the same request (greedy; n=2 and seeded sampling
   too; stop strings with their finish reason); usage counts; OpenAI's chunk format, the usage
   chunk and `data: [DONE]`;
2. 32 concurrent greedy streams (the async client) all complete with generate's tokens;
3. a client that disconnects mid-stream gets its request aborted: /health's free KV blocks are
   back to all of them within a deadline;
4. bad requests get 400 (404 for an unknown model) with OpenAI's error JSON, and the server
   keeps serving;
5. SIGTERM, with a stream in flight, ends the server (a tensor-parallel one, so that it has a
   child process) with exit code 0 within a deadline, and no child process outlives it.

In process (no HTTP): the engine loop holds the LLM (generate() raises while it runs), aborts
free blocks, and the flags cover every Config field. Every loop is bounded in count and time.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

sys.path.insert(0, os.path.dirname(__file__))

from helpers import BLOCK, greedy, make_llm, rand_ids, tiny_checkpoint  # noqa: E402

from nanovllm import SamplingParams  # noqa: E402
from nanovllm.serve.launcher import ServerProcess  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCKS = 128
PREPARE_TIMEOUT_S = 4.0
# On the CPU also on a GPU machine: the offline engine it is compared with computes the same fp32 numbers.
SERVER_ARGS = ["--device", "cpu", "--kvcache-block-size", str(BLOCK), "--num-kvcache-blocks", str(BLOCKS),
               "--max-num-seqs", "64", "--max-num-batched-tokens", "256", "--log-level", "warning",
               # request chat templates (a test's template raises; another one runs too long)
               "--trust-request-chat-template", "--prepare-timeout", str(PREPARE_TIMEOUT_S)]
IGNORE_EOS = {"ignore_eos": True, "return_token_ids": True}
DEADLINE_S = 60.0  # any single request


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")  # this checkout's nanovllm
    return env


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory, "gqa")


@pytest.fixture(scope="module")
def server(ckpt):
    proc = ServerProcess(ckpt, SERVER_ARGS, timeout=180, cwd=ROOT, env=_env())
    yield proc
    proc.stop(30)


@pytest.fixture(scope="module")
def offline(ckpt):
    """The offline engine with the server's options (but mixed steps: generate's default)."""
    llm = make_llm(ckpt, device="cpu", num_kvcache_blocks=BLOCKS, max_num_seqs=64, max_num_batched_tokens=256)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=DEADLINE_S, max_retries=0)


def health(server) -> dict:
    return httpx.get(server.url + "/health", timeout=10).json()


def wait_idle(server, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = health(server)
        if h["free_kv_blocks"] == h["num_kv_blocks"] and h["requests"] == 0:
            return h
        assert time.monotonic() < deadline, f"KV blocks not all free within {timeout} s: {h}"
        time.sleep(0.05)


# ---------------------------------------------------------------------------- basics
def test_models_and_health(server, client, ckpt):
    models = client.models.list().data
    assert [m.id for m in models] == [ckpt]
    h = health(server)
    assert h["status"] == "ok" and h["num_kv_blocks"] == BLOCKS and h["free_kv_blocks"] == BLOCKS


def test_completion_matches_generate(client, offline, ckpt):
    prompt = rand_ids(11, seed=1)
    out = client.completions.create(model=ckpt, prompt=prompt, max_tokens=12, temperature=0, extra_body=IGNORE_EOS)
    ref = offline.generate([prompt], greedy(12), use_tqdm=False)[0].outputs[0]
    choice = out.choices[0]
    assert choice.token_ids == ref.token_ids and choice.text == ref.text
    assert choice.finish_reason == "length" and choice.index == 0
    assert out.usage.prompt_tokens == 11 and out.usage.completion_tokens == 12 and out.usage.total_tokens == 23
    assert out.object == "text_completion" and out.model == ckpt
    # a text prompt, tokenized by the server as generate tokenizes it
    text = "Hello world, nano"
    out = client.completions.create(model=ckpt, prompt=text, max_tokens=6, temperature=0, extra_body=IGNORE_EOS)
    ref = offline.generate(text, greedy(6), use_tqdm=False)[0]
    assert out.choices[0].text == ref.outputs[0].text and out.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_completion_of_several_prompts_with_n2_and_seed(client, offline, ckpt):
    prompts = [rand_ids(5, seed=2), rand_ids(9, seed=3)]
    body = dict(model=ckpt, prompt=prompts, max_tokens=8, temperature=1.0, n=2, seed=1234, extra_body=IGNORE_EOS)
    out = client.completions.create(**body)
    sp = SamplingParams(temperature=1.0, n=2, seed=1234, max_tokens=8, ignore_eos=True)
    ref = offline.generate(prompts, sp, use_tqdm=False)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.token_ids for c in out.choices] == [c.token_ids for r in ref for c in r.outputs]
    assert out.usage.prompt_tokens == 14 and out.usage.completion_tokens == 32
    again = client.completions.create(**body)  # the seed makes it reproducible
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in out.choices]


def test_sampling_fields_reach_the_engine(client, offline, ckpt):
    prompt = rand_ids(8, seed=11)
    # logit_bias (OpenAI's string keys) forces a token; top_k / repetition_penalty / min_tokens come
    # through extra_body as vLLM's fields; penalties as OpenAI's
    out = client.completions.create(model=ckpt, prompt=prompt, max_tokens=5, temperature=0, logit_bias={"42": 100},
                                    extra_body=IGNORE_EOS)
    assert out.choices[0].token_ids == [42] * 5
    fields = dict(temperature=0.7, top_p=0.9, seed=5, presence_penalty=0.5, frequency_penalty=0.3)
    extra = dict(top_k=20, min_p=0.05, repetition_penalty=1.2, **IGNORE_EOS)
    out = client.completions.create(model=ckpt, prompt=prompt, max_tokens=10, extra_body=extra, **fields)
    sp = SamplingParams(max_tokens=10, ignore_eos=True, top_k=20, min_p=0.05, repetition_penalty=1.2, **fields)
    assert out.choices[0].token_ids == offline.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids


def test_completion_streaming_gives_the_same_text_and_a_usage_chunk(client, offline, ckpt):
    prompt = rand_ids(7, seed=4)
    ref = offline.generate([prompt], greedy(16), use_tqdm=False)[0].outputs[0]
    chunks = list(client.completions.create(model=ckpt, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=IGNORE_EOS))
    assert all(c.object == "text_completion" for c in chunks)
    body, last = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in body) == ref.text
    assert [t for c in body for t in c.choices[0].token_ids] == ref.token_ids
    assert [c.choices[0].finish_reason for c in body] == [None] * (len(body) - 1) + ["length"]
    assert all(c.usage is None for c in body)
    assert last.choices == [] and last.usage.completion_tokens == 16 and last.usage.prompt_tokens == 7


def test_streams_end_with_done(server, ckpt):
    lines = []
    body = {"model": ckpt, "prompt": "Hi", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=DEADLINE_S) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                lines.append(line)
    assert lines[-1] == "data: [DONE]" and all(x.startswith("data: ") for x in lines)
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")


def test_stop_strings(client, offline, ckpt):
    prompt = rand_ids(6, seed=5)
    full = offline.generate([prompt], greedy(24), use_tqdm=False)[0].outputs[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop, full
    ref = offline.generate([prompt], greedy(24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert ref.finish_reason == "stop"
    for stream in (False, True):
        out = client.completions.create(model=ckpt, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                        stream=stream, extra_body=IGNORE_EOS)
        choices = [c.choices[0] for c in out] if stream else out.choices
        assert "".join(c.text for c in choices) == ref.text
        assert choices[-1].finish_reason == "stop" and stop not in ref.text


def test_completion_logprobs_equal_generate(client, offline, ckpt):
    prompt = rand_ids(9, seed=6)
    out = client.completions.create(model=ckpt, prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                    extra_body=IGNORE_EOS)
    ref = offline.generate([prompt], greedy(6, logprobs=3), use_tqdm=False)[0].outputs[0]
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for i, (token, entry) in enumerate(zip(ref.token_ids, ref.logprobs)):
        chosen = entry[token]
        # the same computation (a lone request: the same steps), so equal up to the JSON round trip
        assert lp.token_logprobs[i] == pytest.approx(chosen.logprob, abs=1e-6)
        assert lp.tokens[i] == chosen.decoded_token
        top = sorted(entry.values(), key=lambda x: x.rank)[:3]
        assert lp.top_logprobs[i] == {x.decoded_token: pytest.approx(x.logprob, abs=1e-6) for x in top}
    offsets = lp.text_offset
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], lp.tokens))


def test_echo_with_logprobs_scores_the_prompt_as_generate_does(client, offline, ckpt):
    """What evaluation harnesses send to score a text (lm-eval's loglikelihood): echo=True,
    logprobs=k, max_tokens=0. The choice is the prompt alone, its tokens in the legacy logprobs
    format (the first with no logprob), each equal to offline generate's prompt_logprobs; with
    max_tokens > 0 the generated tokens follow, as without echo. vLLM's prompt_logprobs field
    gives the same numbers in its own format, on completions and (response-level) chat."""
    text = "the primes below thirty are two three five seven"
    ref = offline.generate(text, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2,
                                                prompt_logprobs=2), use_tqdm=False)[0]
    ids = ref.prompt_token_ids
    out = client.completions.create(model=ckpt, prompt=text, max_tokens=0, echo=True, logprobs=2, temperature=0)
    c = out.choices[0]
    assert c.text == text and c.finish_reason == "length" and out.usage.completion_tokens == 0
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        entry = ref.prompt_logprobs[i]
        assert lp.token_logprobs[i] == pytest.approx(entry[ids[i]].logprob, abs=1e-6)
        assert lp.tokens[i] == entry[ids[i]].decoded_token
        top = sorted(entry.values(), key=lambda x: x.rank)[:2]
        assert lp.top_logprobs[i] == {x.decoded_token: pytest.approx(x.logprob, abs=1e-6) for x in top}
    assert "".join(lp.tokens) == text  # (this tokenizer's tokens decode one by one to the text)
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    # with generated tokens after the prompt's
    out = client.completions.create(model=ckpt, prompt=text, max_tokens=3, echo=True, logprobs=2, temperature=0,
                                    extra_body=IGNORE_EOS)
    c = out.choices[0]
    gen = ref.outputs[0]
    assert c.text == text + gen.text and c.token_ids == gen.token_ids and out.usage.completion_tokens == 3
    tail = c.logprobs.token_logprobs[len(ids):]
    assert tail == pytest.approx([e[t].logprob for t, e in zip(gen.token_ids, gen.logprobs)], abs=1e-6)
    # vLLM's prompt_logprobs: {token id: {logprob, rank, decoded_token}} per position, None first
    out = client.completions.create(model=ckpt, prompt=text, max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    got = out.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    # echo's legacy logprobs ask the engine for more: the field still gets the prompt token + its k
    both = client.completions.create(model=ckpt, prompt=text, max_tokens=0, echo=True, logprobs=3,
                                     extra_body={"prompt_logprobs": 0}).choices[0].model_extra["prompt_logprobs"]
    assert [list(e) for e in both[1:]] == [[str(t)] for t in ids[1:]]
    for i in range(1, len(ids)):
        assert got[i] == {str(t): {"logprob": pytest.approx(lp_.logprob, abs=1e-6), "rank": lp_.rank,
                                   "decoded_token": lp_.decoded_token} for t, lp_ in ref.prompt_logprobs[i].items()}
    chat = client.chat.completions.create(model=ckpt, messages=MESSAGES, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    want = offline.chat_prompt_ids(MESSAGES)
    got = chat.model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want) and all(str(t) in e for t, e in zip(want[1:], got[1:]))
    for body, needle in [({"echo": True, "logprobs": 1, "stream": True}, "stream"),
                         ({"max_tokens": 0}, "max_tokens"),
                         ({"echo": True, "max_tokens": 0, "stream": True}, "stream"),
                         ({"prompt_logprobs": 1, "stream": True}, "stream")]:
        r = httpx.post(client.base_url.join("completions").__str__(), json={"model": ckpt, "prompt": "x", **body},
                       timeout=DEADLINE_S)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (body, r.text)


# ---------------------------------------------------------------------------- chat
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "list the primes below 30"}]


def test_chat_matches_llm_chat(client, offline, ckpt):
    ref = offline.chat(MESSAGES, greedy(10, logprobs=2), use_tqdm=False)[0]
    out = client.chat.completions.create(model=ckpt, messages=MESSAGES, max_completion_tokens=10, temperature=0,
                                         logprobs=True, top_logprobs=2, extra_body=IGNORE_EOS)
    choice = out.choices[0]
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == ref.outputs[0].text and choice.token_ids == ref.outputs[0].token_ids
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids) and out.usage.completion_tokens == 10
    for item, token, entry in zip(choice.logprobs.content, ref.outputs[0].token_ids, ref.outputs[0].logprobs):
        assert item.logprob == pytest.approx(entry[token].logprob, abs=1e-6) and item.token == entry[token].decoded_token
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(
            sorted((x.logprob for x in entry.values()), reverse=True)[:2], abs=1e-6)
    # streaming: a role chunk first, then the same text; max_tokens (the older name) also works
    chunks = list(client.chat.completions.create(model=ckpt, messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True, extra_body=IGNORE_EOS))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_n2_streams_both_choices(client, offline, ckpt):
    sp = SamplingParams(temperature=0.8, n=2, seed=7, max_tokens=8, ignore_eos=True)
    ref = offline.chat(MESSAGES, sp, use_tqdm=False)[0]
    chunks = list(client.chat.completions.create(model=ckpt, messages=MESSAGES, max_tokens=8, temperature=0.8, n=2,
                                                 seed=7, stream=True, extra_body=IGNORE_EOS))
    for j in range(2):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == j]
        assert [t for c in mine for t in (c.token_ids or [])] == ref.outputs[j].token_ids
        assert mine[-1].finish_reason == "length"


# ---------------------------------------------------------------------------- concurrency
def test_32_concurrent_greedy_streams_match_generate(client, offline, server, ckpt):
    prompts = [rand_ids(3 + (7 * i) % 40, seed=100 + i) for i in range(32)]
    lengths = [4 + i % 9 for i in range(32)]
    ref = offline.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", timeout=DEADLINE_S, max_retries=0)

    async def one(prompt, n):
        ids, finish = [], None
        stream = await aclient.completions.create(model=ckpt, prompt=prompt, max_tokens=n, temperature=0,
                                                  stream=True, extra_body=IGNORE_EOS)
        async for chunk in stream:
            ids.extend(chunk.choices[0].token_ids)
            finish = chunk.choices[0].finish_reason or finish
        return ids, finish

    async def all_of_them():
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths))), 120)
        finally:
            await aclient.close()

    got = asyncio.run(all_of_them())
    for i, ((ids, finish), r) in enumerate(zip(got, ref)):
        assert ids == r.outputs[0].token_ids, f"stream {i}"
        assert finish == "length"
    wait_idle(server)


def test_a_client_that_disconnects_gets_its_blocks_freed(server, ckpt):
    wait_idle(server)
    body = {"model": ckpt, "prompt": rand_ids(40, seed=8), "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    held = None
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=DEADLINE_S) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i == 10:  # some tokens arrived: the request holds KV blocks now
                held = health(server)
                break
    # leaving the block closed the connection mid-stream
    assert held is not None and held["free_kv_blocks"] < BLOCKS and held["requests"] == 1, held
    idle = wait_idle(server, timeout=15)
    assert idle["steps"] - held["steps"] < 350, "the request ran on instead of being aborted"


# ---------------------------------------------------------------------------- errors
BAD_BODIES = [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),          # a field of the wrong type
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "no_such_field": 1}, "no_such_field"),            # unknown fields are refused
    ({"prompt": "x", "max_tokens": 100000}, "max_model_len"),          # too long
    ({"prompt": "x", "temperature": -1}, "temperature"),               # SamplingParams' checks
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "logprobs": 1000}, "max_logprobs"),
    ({"prompt": [10**9]}, "vocabulary"),                               # the engine's prompt checks
    ({"prompt": ""}, "empty"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
]


@pytest.mark.parametrize("body,needle", BAD_BODIES, ids=[n for _, n in BAD_BODIES])
def test_bad_requests_get_400_with_a_message(server, ckpt, body, needle):
    r = httpx.post(server.url + "/v1/completions", json={"model": ckpt, **body}, timeout=DEADLINE_S)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert needle in err["message"] or err["param"] == needle, err


def test_bad_requests_through_the_client_and_the_server_keeps_serving(client, server, ckpt):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=ckpt, prompt="x", max_tokens=10**6)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=ckpt, messages=[{"role": "wizard", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=ckpt, messages=MESSAGES, max_tokens=2, temperature=-3)
    with pytest.raises(openai.BadRequestError, match="boom"):  # a template that raises: that request only
        client.chat.completions.create(model=ckpt, messages=MESSAGES, max_tokens=2, extra_body={
            "chat_template_kwargs": {"chat_template": "{{ raise_exception('boom') }}"}})
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert e.value.status_code == 404 and "no-such-model" in str(e.value)
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    assert httpx.get(server.url + "/v1/nothing", timeout=10).status_code == 404
    out = client.completions.create(model=ckpt, prompt="still here", max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")
    wait_idle(server)


# ---------------------------------------------------------------------------- what one request may carry
MAX_ECHO = 1100  # errors.MAX_MESSAGE_CHARS and the note of what was cut
LIMIT_BODIES = [
    ({"prompt": "x", "stop": ["s%d" % i for i in range(33)]}, "at most 32 stop strings"),
    ({"prompt": "x", "stop": "s" * 257}, "at most 256 characters"),
    ({"prompt": "x", "bad_words": ["w%d" % i for i in range(129)]}, "at most 128 bad words"),
    ({"prompt": "x", "bad_words": ["w" * 257]}, "at most 256 characters"),
    ({"prompt": "x", "logit_bias": {str(i): 1.0 for i in range(1025)}}, "at most 1024 entries"),
    ({"prompt": "x", "stop_token_ids": list(range(1025))}, "at most 1024"),
    ({"prompt": "x" * (32 * 512 + 1)}, "characters is too long"),          # (the tiny model's max_model_len: 512)
    ({"prompt": [1] * 513}, "longer than max_model_len"),
    # a whole input is never echoed: 1,000 ids outside the vocabulary, 20,000 stop strings
    ({"prompt": "x", "stop_token_ids": list(range(10**6, 10**6 + 1000))}, "vocabulary"),
    ({"prompt": "x", "stop": ["s%d" % i for i in range(20000)]}, "at most 32 stop strings"),
]


@pytest.mark.parametrize("body,needle", LIMIT_BODIES, ids=[n for _, n in LIMIT_BODIES])
def test_what_one_request_may_carry_is_bounded_with_a_short_400(server, ckpt, body, needle):
    r = httpx.post(server.url + "/v1/completions", json={"model": ckpt, **body}, timeout=DEADLINE_S)
    assert r.status_code == 400, r.text[:300]
    message = r.json()["error"]["message"]
    assert needle in message and len(message) <= MAX_ECHO, message[:300]


def test_text_that_is_not_unicode_is_a_400_naming_it(server, ckpt):
    """JSON may carry a lone surrogate, which no tokenizer takes: a 400 naming the field."""
    for route, raw, needle in [("/v1/completions", b'{"prompt": "ab\\ud800c", "max_tokens": 2}', "prompt"),
                               ("/v1/completions", b'{"prompt": "x", "stop": ["\\udfff"]}', "stop[0]"),
                               ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}',
                                "messages[0].content")]:
        r = httpx.post(server.url + route, content=raw, headers={"content-type": "application/json"},
                       timeout=DEADLINE_S)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert needle in message and "surrogate" in message, message
    wait_idle(server)


# A chat template that would render for minutes (10^9 loop turns): runs in a preparer worker,
# which the server kills after --prepare-timeout.
SLOW_TEMPLATE = ("{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(1000) %}{% endfor %}"
                 "{% endfor %}{% endfor %}hi")


def test_a_chat_template_that_runs_too_long_is_a_400_and_others_are_served_meanwhile(server, client, ckpt):
    """The template renders off the engine (other requests complete while it runs) and no longer
    than the server's --prepare-timeout: a 400 naming the bound, and its worker process ends."""
    workers = set(_children(server.proc.pid)) - {server.engine_pid}
    done = threading.Event()
    latencies = []

    def others():
        while not done.is_set() and len(latencies) < 200:
            t = time.monotonic()
            client.completions.create(model=ckpt, prompt=rand_ids(6, seed=len(latencies)), max_tokens=4,
                                      temperature=0, extra_body=IGNORE_EOS)
            latencies.append(time.monotonic() - t)

    thread = threading.Thread(target=others)
    thread.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(openai.BadRequestError, match="took longer than"):
            client.chat.completions.create(model=ckpt, messages=MESSAGES, max_tokens=2,
                                           extra_body={"chat_template_kwargs": {"chat_template": SLOW_TEMPLATE}})
        took = time.monotonic() - t0
    finally:
        done.set()
        thread.join(DEADLINE_S)
    assert PREPARE_TIMEOUT_S <= took < PREPARE_TIMEOUT_S + 30
    assert len(latencies) >= 3 and max(latencies) < PREPARE_TIMEOUT_S, latencies  # never waited for the template
    deadline = time.monotonic() + 30
    while workers <= set(p for p in _children(server.proc.pid) if _alive(p)):
        assert time.monotonic() < deadline, "the worker rendering the template was not killed"
        time.sleep(0.1)
    out = client.chat.completions.create(model=ckpt, messages=MESSAGES, max_tokens=2, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")
    wait_idle(server)


# ---------------------------------------------------------------------------- models, tokenize, api key
def test_models_retrieve(client, ckpt):
    """GET /v1/models/{id}: the client path-quotes the id (a checkpoint path has slashes)."""
    m = client.models.retrieve(ckpt)
    assert m.id == ckpt and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no/such-model")


def test_tokenize_and_detokenize_are_the_engines(server, offline, ckpt):
    """vLLM's /tokenize and /detokenize give what the offline engine's tokenizer and chat
    template give; bad bodies get 400 and nothing is left in the engine."""
    post = lambda route, body: httpx.post(server.url + route, json=body, timeout=DEADLINE_S)  # noqa: E731
    text = "the primes below 30, briefly"
    r = post("/tokenize", {"model": ckpt, "prompt": text})
    assert r.status_code == 200, r.text
    ids = offline.tokenize(text)
    assert r.json() == {"count": len(ids), "max_model_len": offline.config.max_model_len, "tokens": ids}
    chat = post("/tokenize", {"messages": MESSAGES}).json()
    assert chat["tokens"] == offline.chat_prompt_ids(MESSAGES) and chat["count"] == len(chat["tokens"])
    given = rand_ids(9, seed=21)
    assert post("/tokenize", {"prompt": given}).json()["tokens"] == given
    assert post("/detokenize", {"model": ckpt, "tokens": ids}).json() == {"prompt": offline.tokenizer.decode(ids)}
    assert post("/detokenize", {"tokens": []}).json() == {"prompt": ""}
    assert post("/tokenize", {"prompt": ""}).json()["count"] == 0  # (as vLLM)
    for route, body, needle in [("/tokenize", {"prompt": "x", "messages": MESSAGES}, "exactly one"),
                                ("/tokenize", {}, "exactly one"),
                                ("/tokenize", {"prompt": "x", "add_special_tokens": True}, "add_special_tokens"),
                                ("/detokenize", {"tokens": [10**9]}, "vocabulary"),
                                ("/detokenize", {"tokens": "abc"}, "tokens")]:
        r = post(route, body)
        assert r.status_code == 400 and needle in r.text, (route, body, r.text)
    assert post("/tokenize", {"model": "other", "prompt": "x"}).status_code == 404
    wait_idle(server)


def scrape(server, model: str) -> dict:
    """GET /metrics parsed: {(sample name, frozenset of its labels but model_name): value}, and
    every sample's model_name label checked."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if not sample.name.startswith("vllm:"):
                continue
            labels = dict(sample.labels)
            assert labels.pop("model_name") == model, sample
            out[sample.name, frozenset(labels.items())] = sample.value
    return out


def test_metrics_count_what_the_clients_saw(server, client, ckpt):
    """GET /metrics (Prometheus, vLLM's names): across a completion, a chat, an n=2 completion
    and a stream the client leaves early, the counters grow by exactly the usage the responses
    reported and by one finished request each (under its finish reason, "abort" for the one left);
    the latency histograms count those requests; idle, the gauges read an empty engine."""
    wait_idle(server)
    before = scrape(server, ckpt)
    usages = [client.completions.create(model=ckpt, prompt=rand_ids(9, seed=41), max_tokens=5, temperature=0,
                                        extra_body=IGNORE_EOS).usage,
              client.chat.completions.create(model=ckpt, messages=MESSAGES, max_tokens=4, temperature=0,
                                             extra_body={"ignore_eos": True}).usage,
              client.completions.create(model=ckpt, prompt=rand_ids(6, seed=42), max_tokens=3, n=2, seed=5,
                                        extra_body=IGNORE_EOS).usage,
              # echo, max_tokens=0: its one hidden token is neither returned nor counted
              client.completions.create(model=ckpt, prompt=rand_ids(7, seed=44), max_tokens=0, echo=True).usage]
    body = {"model": ckpt, "prompt": rand_ids(12, seed=43), "max_tokens": 300, "stream": True, "ignore_eos": True}
    streamed = 0
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=DEADLINE_S) as r:
        for line in r.iter_lines():
            streamed += line.startswith("data: {")
            if streamed == 5:
                break
    wait_idle(server)
    after = scrape(server, ckpt)

    def grew(name, **labels):
        key = (name, frozenset(labels.items()))
        return after[key] - before.get(key, 0.0)

    assert grew("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages) + 12
    generated = sum(u.completion_tokens for u in usages)
    assert generated == 5 + 4 + 6
    assert generated + 5 <= grew("vllm:generation_tokens_total") < generated + 300  # the stream: left after 5
    assert grew("vllm:request_success_total", finished_reason="length") == 4
    assert grew("vllm:request_success_total", finished_reason="abort") == 1
    assert grew("vllm:time_to_first_token_seconds_count") == 4 and grew("vllm:e2e_request_latency_seconds_count") == 5
    assert grew("vllm:time_to_first_token_seconds_sum") > 0
    # one gap per token batch of a sample after its first: at most (5-1)+(4-1)+2*(3-1) for the three
    assert 11 <= grew("vllm:inter_token_latency_seconds_count") <= 11 + 300
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert after[gauge, frozenset()] == 0.0, gauge


def test_an_api_key_guards_every_route_but_health(offline, ckpt):
    """create_app(api_key=...): the official client without the key, or with another, gets
    401 (openai.AuthenticationError) with OpenAI's error JSON; with it, completions equal
    generate's. In process (the app over an EngineLoop on the offline LLM), through
    Starlette's TestClient as the client's HTTP transport."""
    from fastapi.testclient import TestClient

    from nanovllm.serve.async_engine import EngineLoop
    from nanovllm.serve.app import create_app

    for bad in (" ", "s3cret\n"):
        with pytest.raises(ValueError, match="api_key"):
            create_app(EngineLoop(offline), ckpt, api_key=bad)
    app = create_app(EngineLoop(offline), ckpt, api_key="s3cret")
    prompt = rand_ids(7, seed=31)
    want = offline.generate([prompt], greedy(6), use_tqdm=False)[0].outputs[0].token_ids  # (before the loop holds it)
    tokens_x = offline.tokenize("x")
    with TestClient(app) as http:
        def client(key):
            return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)

        for key in ("none", "s3cret-not"):
            with pytest.raises(openai.AuthenticationError) as e:
                client(key).completions.create(model=ckpt, prompt=prompt, max_tokens=2)
            assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                client(key).models.list()
        for route in ("/tokenize", "/detokenize"):
            assert http.post(route, json={"prompt": "x", "tokens": [1]}).status_code == 401
        # the key is checked before the body is read: no parse error for a client without it
        r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/openapi.json").status_code == 401 and http.get("/docs").status_code == 401
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
        out = client("s3cret").completions.create(model=ckpt, prompt=prompt, max_tokens=6, temperature=0,
                                                  extra_body=IGNORE_EOS)
        assert out.choices[0].token_ids == want
        r = http.post("/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["tokens"] == tokens_x
    assert not offline._busy.locked()  # the app's lifespan stopped the loop: the LLM is free again


def test_detokenize_without_a_tokenizer_is_a_400(ckpt):
    """An engine started with skip_tokenizer_init has no text to give: /detokenize says so (400)
    instead of answering an empty text; /tokenize of token ids still works."""
    from fastapi.testclient import TestClient

    from nanovllm.serve.async_engine import EngineLoop
    from nanovllm.serve.app import create_app

    llm = make_llm(ckpt, device="cpu", skip_tokenizer_init=True, num_kvcache_blocks=16)
    try:
        with TestClient(create_app(EngineLoop(llm), ckpt)) as http:
            r = http.post("/detokenize", json={"tokens": [5, 6]})
            assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
            assert http.post("/tokenize", json={"prompt": [5, 6]}).json()["tokens"] == [5, 6]
    finally:
        llm.shutdown()


def test_an_empty_api_key_is_refused_before_any_work(capsys):
    from nanovllm.serve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["/no/such/model", "--api-key", " "])
    assert exit_info.value.code == 2 and "--api-key" in capsys.readouterr().err


# ---------------------------------------------------------------------------- in process
def test_the_engine_loop_owns_the_llm_and_aborts_free_blocks(offline):
    from nanovllm.serve.async_engine import Accepted, Delta, EngineLoop, EngineRequest, Failed, Finished

    events, arrived = [], threading.Event()

    def sink(event):
        events.append(event)
        arrived.set()

    loop = EngineLoop(offline)
    loop.start()
    try:
        with pytest.raises(RuntimeError, match="already generating"):
            offline.generate([[1, 2, 3]], greedy(2), use_tqdm=False)
        done = EngineRequest(rand_ids(5, seed=9), greedy(3), sink)
        long = EngineRequest(rand_ids(5, seed=10), greedy(400), sink)
        bad = EngineRequest([1, 2], SamplingParams(max_tokens=10**6), sink)
        loop.submit([done])
        loop.submit([long])
        loop.submit([bad])
        deadline = time.monotonic() + 30
        while not (any(isinstance(e, Finished) for e in events) and any(isinstance(e, Failed) for e in events)):
            assert arrived.wait(max(0.0, deadline - time.monotonic())), f"no events in time: {events}"
            arrived.clear()
        loop.abort(long)
        while loop.stats.free_kv_blocks != loop.stats.num_kv_blocks or loop.stats.requests:
            assert time.monotonic() < deadline, loop.stats
            time.sleep(0.01)
        assert isinstance(events[0], Accepted)
        deltas = [e for e in events if isinstance(e, Delta)]
        assert sum(len(d.token_ids) for d in deltas if d.finish_reason is not None) >= 1
        assert isinstance(next(e for e in events if isinstance(e, Failed)).error, ValueError)
    finally:
        loop.stop()
    assert not loop.running
    assert offline.generate([[1, 2, 3]], greedy(2), use_tqdm=False)[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_chunks_are_the_json_of_the_whole_chunk(include_usage):
    """Chunks encodes the head once and splices each choice in: the same JSON as encoding the
    whole chunk object."""
    from nanovllm.serve.protocol import CompletionRequest
    from nanovllm.serve.streaming import Chunks

    body = CompletionRequest(prompt="x", stream=True, stream_options={"include_usage": include_usage})
    head = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m \"q\""}
    choice = {"index": 1, "text": "caf\u00e9\n", "logprobs": None, "finish_reason": None, "token_ids": [3, 4]}
    line = Chunks(head, body, 5).choice(choice, 2)
    assert line.startswith("data: ") and line.endswith("\n\n")
    want = {**head, "choices": [choice], **({"usage": None} if include_usage else {})}
    assert json.loads(line[6:]) == want and line[6:-2] == json.dumps(want)


def test_every_config_field_is_a_flag():
    from nanovllm.serve.cli import build_parser, config_fields, llm_options

    parser = build_parser()
    flags = {a.dest: a for a in parser._actions}
    assert "tensor_parallel_size" in config_fields() and "max_num_seqs" in config_fields()
    for name in config_fields():
        assert name in flags and flags[name].help, f"LLM option {name} has no flag"
    args = parser.parse_args(["/m", "--max-num-seqs", "7", "--no-enable-prefix-caching", "--dtype", "float16",
                              "--gpu-memory-utilization", "0.5"])
    assert llm_options(args) == {"max_num_seqs": 7, "enable_prefix_caching": False, "dtype": "float16",
                                 "gpu_memory_utilization": 0.5, "mixed_steps": True}
    assert llm_options(parser.parse_args(["/m", "--no-mixed-steps"])) == {"mixed_steps": False}


@pytest.mark.parametrize("flags", [["--data-parallel-size", "2"], ["--distributed-executor-backend", "ray"]])
def test_a_data_parallel_server_is_refused_before_any_work(flags, capsys):
    """The engine loop drives one in-process engine: the server says so at once, before it
    loads anything (the model path does not exist) or starts a replica."""
    from nanovllm.serve.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["/no/such/model", *flags])
    assert exit_info.value.code == 2
    assert "one server per replica" in capsys.readouterr().err


def test_the_engine_loop_refuses_a_data_parallel_llm():
    from nanovllm.serve.async_engine import EngineLoop
    from nanovllm.data_parallel_front import data_parallel_llm
    from nanovllm.llm import LLM

    with pytest.raises(ValueError, match="drives one engine in this process"):
        EngineLoop(object.__new__(data_parallel_llm(LLM)))  # (no replicas started: the check comes first)


def test_serve_bench_runs_and_reports(ckpt, tmp_path):
    """benchmarks/serve_bench.py end to end on the tiny model (a few short requests): its own
    server, the JSON report, and offline generate on the same requests."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import serve_bench

    out = tmp_path / "serve.json"
    assert serve_bench.main(["--model", ckpt, "--clients", "3", "--requests", "5", "--min-input", "4",
                             "--max-input", "30", "--min-output", "3", "--max-output", "9", "--out", str(out),
                             "--closed-loop", "--keep-logs", str(tmp_path / "logs"),
                             "--server-args", f"--device cpu --kvcache-block-size {BLOCK} --num-kvcache-blocks 64"]) == 0
    report = json.loads(out.read_text())
    s = report["server"]
    with open(os.path.join(ckpt, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    _, lengths = serve_bench.workload(5, vocab, 4, 30, 3, 9)
    assert s["output_tokens"] == report["offline"]["output_tokens"] == sum(lengths)
    assert s["exit_code"] == 0 and s["ttft_ms"]["n"] == 5 and s["itl_ms"]["n"] == sum(lengths) - 5
    assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p99"] and 0 < s["itl_ms"]["p50"] <= s["itl_ms"]["p99"]
    assert report["server_vs_offline"] > 0
    # The engine alone at the clients' concurrency (at most 3 requests at a time): the same tokens.
    assert report["offline_at_clients"]["output_tokens"] == sum(lengths)
    assert report["server_vs_offline_at_clients"] > 0
    steps = s["engine_steps"]  # the server's --step-log, over the timed run
    assert steps["decode"]["steps"] + steps["prompt"]["steps"] > 0 and steps["prompt"]["steps"] >= 1
    closed = report["closed_loop"]  # the same engine and requests without HTTP
    assert closed["output_tokens"] == sum(lengths) and closed["ttft_ms"]["n"] == 5
    assert closed["itl_ms"]["n"] == sum(lengths) - 5 and closed["output_tok_s"] > 0
    assert closed["engine_steps"]["prompt"]["steps"] >= 1 and closed["triton_compiles"] >= 0
    kept = json.loads((tmp_path / "logs" / "server_requests.json").read_text())  # --keep-logs
    assert [r["max_tokens"] for r in kept] == lengths and [len(r["stamps"]) >= 1 for r in kept] == [True] * 5
    assert sum(r["tokens"] for r in kept) == sum(lengths)
    assert (tmp_path / "logs" / "server_steps.jsonl").read_text().count("\n") >= steps["decode"]["steps"]
    steady = s["steady_state"]  # (3 clients, 5 requests: the window may be empty)
    assert steady["window_s"] >= 0 and (steady["output_tok_s"] is None or steady["output_tok_s"] > 0)


# ---------------------------------------------------------------------------- shutdown (last)
def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out.extend(int(x) for x in f.read().split())
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads child processes from /proc")
def test_sigterm_shuts_down_cleanly_with_a_stream_in_flight(ckpt, server):
    server.stop(30)  # the module's server is done: give its cores back
    args = SERVER_ARGS + ["--tensor-parallel-size", "2", "--shutdown-timeout", "2"]
    with ServerProcess(ckpt, args, timeout=180, cwd=ROOT, env=_env()) as tp:
        kids = _children(tp.proc.pid)  # the engine's process, and under it the tensor-parallel worker
        kids += [g for k in kids for g in _children(k)]
        assert len(kids) >= 2, "a tensor-parallel server has an engine process and a worker under it"
        body = {"model": ckpt, "prompt": "Hello", "max_tokens": 400, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", tp.url + "/v1/completions", json=body, timeout=DEADLINE_S) as r:
            lines = r.iter_lines()
            for _ in range(4):
                next(lines)
            t0 = time.monotonic()
            tp.proc.send_signal(signal.SIGTERM)
            rest = [x for x in lines if x]  # the stream ends cleanly, also when ended by the shutdown
        assert tp.proc.wait(60) == 0
        assert time.monotonic() - t0 < 60
        assert rest[-1] == "data: [DONE]"
        last = json.loads(rest[-2][6:])
        assert last.get("error", {}).get("code") is None and "shutting down" in last["error"]["message"] \
            if "error" in last else last["choices"][0]["finish_reason"] == "length"
        deadline = time.monotonic() + 10
        while any(_alive(k) for k in kids):
            assert time.monotonic() < deadline, f"child processes {[k for k in kids if _alive(k)]} outlived the server"
            time.sleep(0.1)
