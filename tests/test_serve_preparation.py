"""Where a server's request is prepared: small requests by the engine itself (as before the
preparer workers: ~0.1 ms there, against a worker round trip and a queue behind two workers),
anything larger in the preparer workers, so that one huge request never holds up the streams
(issue 40 item 3; the end-to-end cases are in test_serve / test_serve_hardening)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")

from nanovllm import SamplingParams  # noqa: E402
from nanovllm.serve.async_engine import ChatPrompt, EngineRequest  # noqa: E402
from nanovllm.serve.preparation import SMALL_LISTS, SMALL_PROMPT, is_small  # noqa: E402
from nanovllm.serve.run import Run  # noqa: E402


def request(prompt, **params) -> EngineRequest:
    return EngineRequest(prompt, SamplingParams(**params), lambda event: None)


@pytest.mark.parametrize("r", [
    request("Hello"), request("x" * SMALL_PROMPT), request(list(range(SMALL_PROMPT))),
    request(ChatPrompt([{"role": "user", "content": "hi"}])), request("a", stop=["\n"] * SMALL_LISTS),
    request("a", logit_bias={i: 1.0 for i in range(SMALL_LISTS)}), request("a", bad_words=["x"]),
], ids=["text", "longest_small_text", "token_ids", "chat", "stops", "bias", "bad_words"])
def test_small_requests_stay_with_the_engine(r):
    assert is_small(r)


@pytest.mark.parametrize("r", [
    request("x" * (SMALL_PROMPT + 1)), request(list(range(SMALL_PROMPT + 1))),
    request(ChatPrompt([{"role": "user", "content": "hi"}], {"enable_thinking": False})),
    request(ChatPrompt([{"role": "user", "content": "x" * (SMALL_PROMPT + 1)}])),
    request(ChatPrompt([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])),
    request("a", stop=["\n"] * (SMALL_LISTS + 1)), request("a", stop=["x" * 4000, "y" * 4000, "z" * 400]),
    request("a", logit_bias={i: 1.0 for i in range(SMALL_LISTS + 1)}),
    request("a", allowed_token_ids=list(range(2000))), request({"prompt": "a dict"}),
], ids=["long_text", "many_ids", "template_kwargs", "long_chat", "content_parts", "stops", "long_stop", "bias",
        "allowed_ids", "prompt_dict"])
def test_larger_requests_go_to_the_workers(r):
    assert not is_small(r)


class RecordingPreparer:
    def __init__(self):
        self.calls = []

    async def prepare(self, requests):
        self.calls.append(requests)
        return [None] * len(requests)


def test_a_run_sends_only_requests_with_a_large_one_to_the_workers():
    preparer = RecordingPreparer()
    small = Run(None, preparer, None, lambda sink: [request("Hello"), request([1, 2, 3])])
    asyncio.run(small.prepare())
    assert preparer.calls == []
    mixed = Run(None, preparer, None, lambda sink: [request("Hello"), request("x" * (SMALL_PROMPT + 1))])
    asyncio.run(mixed.prepare())
    assert len(preparer.calls) == 1 and len(preparer.calls[0]) == 2  # (prepared together: one refusal for all)
