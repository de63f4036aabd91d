"""POST /v1/completions: its JSON response and its stream (OpenAI's legacy completions, with
vLLM's extras: echo, token ids, prompt logprobs)."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from nanovllm.serve.async_engine import EngineRequest
from nanovllm.serve.errors import bad_request
from nanovllm.serve.limits import check_prompt, check_sampling
from nanovllm.serve.protocol import CompletionRequest, LegacyLogprobs, prompt_logprobs_json, usage
from nanovllm.serve.run import Run, flat
from nanovllm.serve.streaming import Chunks, sse_body


async def create_completion(server, body: CompletionRequest, http: Request):
    """The route's logic over `server` (an OpenAIServer)."""
    lora = server.check_model(body.model)
    try:
        body.check()
        check_sampling(body)
        prompts = body.prompts()
        for i, p in enumerate(prompts):
            check_prompt(f"prompt[{i}]" if len(prompts) > 1 else "prompt", p, server.engine.info.max_model_len)
        params = body.sampling_params(server.defaults, body.max_tokens or 1, body.logprobs, body.echo_logprobs)
    except (ValueError, TypeError, NotImplementedError) as e:
        raise bad_request(e) from None
    run = Run(server.engine, server.preparer, http,
              lambda sink: [EngineRequest(p, params, sink(i), want_prompt_text=bool(body.echo), lora_request=lora)
                            for i, p in enumerate(prompts)],
              watch_disconnect=not body.stream, metrics=server.metrics, count_generated=body.generates)
    await run.start()
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": lora.lora_name if lora else server.name}
    if body.stream:
        return StreamingResponse(sse_body(_stream(run, body, head), run), media_type="text/event-stream",
                                 background=BackgroundTask(run.close))  # (a stream never started)
    return await _json(run, body, head)


def _choices(run: Run, body: CompletionRequest) -> tuple[dict, dict, dict]:
    """(choices, their text pieces, their generated logprob entries), by choice index."""
    n, texts, choices, generated = body.n, {}, {}, {}
    for pi, prompt_text in enumerate(run.prompt_texts):
        for j in range(n):
            texts[pi * n + j] = [prompt_text] if body.echo else []
            generated[pi * n + j] = []
            choices[pi * n + j] = {"index": pi * n + j, "text": "", "logprobs": None, "finish_reason": None,
                                   "stop_reason": None}
            if body.return_token_ids:
                choices[pi * n + j].update(prompt_token_ids=run.prompt_ids[pi], token_ids=[])
    return choices, texts, generated


async def _json(run: Run, body: CompletionRequest, head: dict) -> dict:
    n, gen = body.n, body.generates  # (gen False: echo with max_tokens=0, its one token not returned)
    choices, texts, generated = _choices(run, body)
    prompt_lps: dict[int, list] = {}  # prompt index -> its prompt logprobs (the first delta's)
    tokens = 0
    async for pi, d in flat(run):
        if d.prompt_logprobs is not None:
            prompt_lps[pi] = d.prompt_logprobs
        c = choices[pi * n + d.index]
        if d.finish_reason is not None:
            c["finish_reason"], c["stop_reason"] = (d.finish_reason, d.stop_reason) if gen else ("length", None)
        if not gen:
            continue
        texts[c["index"]].append(d.text)
        tokens += len(d.token_ids)
        if body.return_token_ids:
            c["token_ids"].extend(d.token_ids)
        generated[c["index"]].extend(d.logprobs or ())
    for i, c in choices.items():
        pi = i // n
        c["text"] = "".join(t or "" for t in texts[i])
        if body.logprobs is not None:
            lp = LegacyLogprobs(body.logprobs, 0)
            if body.echo:  # the prompt's tokens first, as scored by the model (the first one: no logprob)
                lp.add(prompt_lps.get(pi) or [], run.first_token_texts[pi])
            lp.add(generated[i])
            c["logprobs"] = lp.json()
        if body.prompt_logprobs is not None:
            c["prompt_logprobs"] = prompt_logprobs_json(prompt_lps.get(pi), body.prompt_logprobs)
    return {**head, "choices": [choices[i] for i in sorted(choices)],
            "usage": usage(sum(map(len, run.prompt_ids)), tokens)}


async def _stream(run: Run, body: CompletionRequest, head: dict):
    n, tokens, lps = body.n, 0, {}
    chunks = Chunks(head, body, sum(map(len, run.prompt_ids)))

    def choice(index, text, logprobs=None, finish=None, stop=None, token_ids=()):
        c = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop}
        if body.return_token_ids:
            c["token_ids"] = list(token_ids)
        return chunks.choice(c, tokens)

    if body.echo:
        yield "".join(choice(pi * n + j, text or "") for pi, text in enumerate(run.prompt_texts)
                      for j in range(n))
    async for batch in run.batches():
        parts = []
        for pi, d in batch:
            index = pi * n + d.index
            tokens += len(d.token_ids)
            logprobs = None
            if body.logprobs is not None:
                if index not in lps:
                    lps[index] = LegacyLogprobs(body.logprobs)
                logprobs = lps[index].add(d.logprobs or [])
            if d.text or d.finish_reason is not None or logprobs is not None or body.return_token_ids:
                parts.append(choice(index, d.text, logprobs, d.finish_reason, d.stop_reason, d.token_ids))
        if parts:
            yield "".join(parts)  # (one write for all this stream's new chunks)
    if body.include_usage:
        yield chunks.usage(tokens)
