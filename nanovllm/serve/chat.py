"""POST /v1/chat/completions: the conversation through the chat template, its JSON response and
its stream. A chat template sent with a request (`chat_template`, or in `chat_template_kwargs`)
is code the server would run: refused unless the server trusts request templates."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from nanovllm.serve.async_engine import ChatPrompt, EngineRequest
from nanovllm.serve.chat_outputs import ChatTools, ChoiceText
from nanovllm.serve.errors import APIError, bad_request
from nanovllm.serve.limits import check_messages, check_sampling
from nanovllm.serve.protocol import ChatCompletionRequest, chat_logprobs, prompt_logprobs_json, usage
from nanovllm.serve.run import Run, flat
from nanovllm.serve.streaming import Chunks, sse_body

UNTRUSTED_TEMPLATE = ("a chat template sent with the request is refused: this server renders only its model's own "
                      "(start it with --trust-request-chat-template to allow request templates)")


def chat_prompt(messages: list, template_kwargs: dict | None, template: str | None, trusted: bool,
                max_model_len: int) -> ChatPrompt:
    """The ChatPrompt of a request's messages (ChatMessage objects) and template options;
    APIError 400 for a request template the server does not trust, ValueError for texts out of
    bounds."""
    kwargs = dict(template_kwargs or {})
    if template is not None:
        kwargs["chat_template"] = template
    if "chat_template" in kwargs and not trusted:
        raise APIError(400, UNTRUSTED_TEMPLATE, param="chat_template")
    conversation = [m.as_template_message() for m in messages]
    check_messages(conversation, max_model_len)
    return ChatPrompt(conversation, kwargs)


async def create_chat_completion(server, body: ChatCompletionRequest, http: Request):
    """The route's logic over `server` (an OpenAIServer)."""
    lora = server.check_model(body.model)
    try:
        body.check()
        check_sampling(body)
        params = body.sampling_params(server.defaults, body.output_limit, body.num_logprobs)
        tools = ChatTools.of(body, params.structured_outputs, server.options.tool_call_parser,
                             server.options.reasoning_parser)
        params.structured_outputs = tools.constraint(body, params.structured_outputs)
        template_kwargs = {**(body.chat_template_kwargs or {}), **({"tools": body.tools} if body.tools else {})}
        prompt = chat_prompt(body.messages, template_kwargs, body.chat_template,
                             server.options.trust_request_chat_template, server.engine.info.max_model_len)
    except (ValueError, TypeError, NotImplementedError) as e:
        raise bad_request(e) from None
    run = Run(server.engine, server.preparer, http,
              lambda sink: [EngineRequest(prompt, params, sink(0), fill_max_tokens=body.output_limit is None,
                                          lora_request=lora)],
              watch_disconnect=not body.stream, metrics=server.metrics)
    await run.start()
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": lora.lora_name if lora else server.name}
    if body.stream:
        head["object"] = "chat.completion.chunk"
        return StreamingResponse(sse_body(_stream(run, body, head, tools), run), media_type="text/event-stream",
                                 background=BackgroundTask(run.close))
    return await _json(run, body, head, tools)


async def _json(run: Run, body: ChatCompletionRequest, head: dict, tools: ChatTools) -> dict:
    k = body.num_logprobs
    choices = [{"index": j, "message": {"role": "assistant", "content": ""},
                "logprobs": {"content": []} if k is not None else None, "finish_reason": None, "stop_reason": None}
               for j in range(body.n)]
    texts = [[] for _ in range(body.n)]
    if body.return_token_ids:
        for c in choices:
            c.update(prompt_token_ids=run.prompt_ids[0], token_ids=[])
    tokens, prompt_lps = 0, None
    async for _, d in flat(run):
        if d.prompt_logprobs is not None:
            prompt_lps = d.prompt_logprobs
        c = choices[d.index]
        texts[d.index].append(d.text)
        tokens += len(d.token_ids)
        if body.return_token_ids:
            c["token_ids"].extend(d.token_ids)
        if k is not None and d.logprobs:
            c["logprobs"]["content"].extend(chat_logprobs(d.logprobs, k))
        if d.finish_reason is not None:
            c["finish_reason"], c["stop_reason"] = d.finish_reason, d.stop_reason
    for c, t in zip(choices, texts):
        text = ChoiceText(tools)
        c["message"] = text.message("".join(t))
        c["finish_reason"] = text.finish_reason(c["finish_reason"])
    out = {**head, "choices": choices, "usage": usage(len(run.prompt_ids[0]), tokens)}
    if body.prompt_logprobs is not None:  # (vLLM's place for them: the response, not a choice)
        out["prompt_logprobs"] = prompt_logprobs_json(prompt_lps, body.prompt_logprobs)
    return out


async def _stream(run: Run, body: ChatCompletionRequest, head: dict, tools: ChatTools):
    k, tokens = body.num_logprobs, 0
    chunks = Chunks(head, body, len(run.prompt_ids[0]))
    texts = [ChoiceText(tools) for _ in range(body.n)]

    def choice(index, delta, logprobs=None, finish=None, stop=None, token_ids=()):
        c = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            c["stop_reason"] = stop
        if body.return_token_ids:
            c["token_ids"] = list(token_ids)
        return chunks.choice(c, tokens)

    yield "".join(choice(j, {"role": "assistant", "content": ""}) for j in range(body.n))
    async for batch in run.batches():
        parts = []
        for _, d in batch:
            tokens += len(d.token_ids)
            logprobs = {"content": chat_logprobs(d.logprobs or [], k)} if k is not None else None
            text, finish = texts[d.index], d.finish_reason
            delta = text.delta(d.text) if d.text else {}
            if finish is not None:
                for key, value in text.last_delta().items():  # (text held back goes after this piece's)
                    delta[key] = delta.get(key, "") + value if isinstance(value, str) else value
                finish = text.finish_reason(finish)
            if delta or finish is not None or logprobs is not None or body.return_token_ids:
                parts.append(choice(d.index, delta, logprobs, finish, d.stop_reason, d.token_ids))
        if parts:
            yield "".join(parts)
    if body.include_usage:
        yield chunks.usage(tokens)
