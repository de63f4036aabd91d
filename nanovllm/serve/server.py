"""An OpenAI-compatible server on nano-vllm's engine: `python -m nanovllm.serve MODEL`.

    pip install -e ".[server]"
    python -m nanovllm.serve /path/to/Qwen3-0.6B --port 8000
    # then any OpenAI client: OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")

Routes: GET /v1/models (and /v1/models/{id}), POST /v1/completions, POST /v1/chat/completions
(`stream: true` as server-sent events in OpenAI's chunk format, ending with `data: [DONE]`; a
usage chunk last when `stream_options.include_usage`), vLLM's POST /tokenize and /detokenize,
GET /health (the engine's free KV blocks and queues), GET /metrics (Prometheus, vLLM's metric
names: server_metrics.py). With `--api-key` (or NANOVLLM_API_KEY) every route but /health and
/metrics wants `Authorization: Bearer KEY` (401 without it). Errors are OpenAI's
JSON ({"error": {"message", "type", "param", "code"}}): 400 for a bad request, 401 for a missing
or wrong key, 404 for an unknown model or route, 500 when the engine failed, 503 once it stopped.

Every `LLM` option is a flag, made from nanovllm/config.py's Config fields (a new option is a
new flag); the server turns mixed steps on by default (decode rows ride along with prompt
chunks, so running streams keep flowing while a long prompt prefills). The engine runs in a
process of its own (engine/engine_process.py: the EngineLoop of engine/async_engine.py in a
child), so that the HTTP side's Python and the engine's steps never wait for each other's GIL;
this process only sends it commands and reads events back. A client that disconnects has its
request aborted and its blocks freed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import os
import signal
import socket
import sys
import time
import typing
import uuid

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm.config import Config, wants_data_parallel
from nanovllm.serve.async_engine import (SINGLE_ENGINE_ONLY, Accepted, ChatPrompt, Delta, EngineLoop, EngineRequest,
                                          EngineStopped, Failed, Finished, call_sinks)
from nanovllm.serve.engine_process import EngineProcess
from nanovllm.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, LegacyLogprobs,
                                      TokenizeRequest, chat_logprobs, error_body, prompt_logprobs_json, usage)
from nanovllm.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from nanovllm.serve.metrics import ServerMetrics

logger = logging.getLogger("nanovllm.serve.server")

# How often a request waiting for tokens checks that its client is still connected (seconds).
DISCONNECT_POLL_S = 0.5


class APIError(Exception):
    """An error the client gets as OpenAI's JSON with this HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), status_code=self.status)


class ClientGone(Exception):
    """The client of a request disconnected."""


def bad_request(e: BaseException) -> APIError:
    return APIError(400, str(e) or type(e).__name__)


# ---------------------------------------------------------------------------- one HTTP request
class Run:
    """The engine requests of one HTTP request (one per prompt) and their events, read on the
    event loop; leaving `batches()` early (a disconnect, a cancelled task) aborts them.
    `watch_disconnect`: check the connection while waiting for events (a JSON response; a
    streaming response's task is cancelled by Starlette itself when its client goes). `metrics`:
    where its tokens and latencies are counted (None: nowhere); `count_generated` False: its
    generated tokens are not returned (echo with max_tokens=0), so not counted either."""

    def __init__(self, engine: EngineLoop | EngineProcess, http: Request, requests_of, watch_disconnect: bool = True,
                 metrics: ServerMetrics | None = None, count_generated: bool = True):
        self.engine, self.http, self.watch, self.metrics = engine, http, watch_disconnect, metrics
        self.count_generated = count_generated
        self.queue: asyncio.Queue = asyncio.Queue()
        self.requests: list[EngineRequest] = requests_of(self._sink)
        self.times = [metrics.request() for _ in self.requests] if metrics is not None else None
        self.prompt_ids: list[list[int]] = []
        self.prompt_texts: list[str | None] = []
        self._open = set(range(len(self.requests)))
        self._accepted: set[int] = set()  # (an aborted request counts as finished only once accepted)

    def _sink(self, index: int):
        return lambda event: self.queue.put_nowait((index, event))

    async def _next(self, watch: bool | None = None):
        """The next (prompt index, event); ClientGone once the client has disconnected (checked
        only when watching: `watch`, else the Run's watch_disconnect)."""
        if not self.queue.empty():
            return self.queue.get_nowait()
        if not (self.watch if watch is None else watch):  # (no timer per token: it costs more than the chunk)
            return await self.queue.get()
        while True:
            try:
                return await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await self.http.is_disconnected():
                    raise ClientGone() from None
                if not self.engine.running and self.queue.empty():  # (it stopped as this was submitted)
                    raise APIError(503, "the server is shutting down", "server_error") from None

    async def start(self) -> None:
        """Submit, and wait until every prompt is accepted (APIError 400 if one is refused)."""
        try:
            self.engine.submit(self.requests)
        except RuntimeError:  # it stopped
            raise APIError(503, "the server is shutting down", "server_error") from None
        accepted: dict[int, Accepted] = {}
        try:
            while len(accepted) < len(self.requests):
                try:
                    index, event = await self._next(watch=True)  # (also: the engine stopping meanwhile)
                except ClientGone:
                    raise APIError(400, "the client disconnected") from None
                if isinstance(event, Failed):
                    self._open.clear()  # all of them were refused together
                    if isinstance(event.error, (ValueError, TypeError, NotImplementedError)):
                        raise bad_request(event.error)
                    raise APIError(503 if isinstance(event.error, EngineStopped) else 500, str(event.error),
                                   "server_error")
                accepted[index] = event
                self._accepted.add(index)
                if self.metrics is not None:
                    self.metrics.prompt_tokens.inc(len(event.prompt_token_ids))
        except BaseException:
            self.close()
            raise
        self.prompt_ids = [accepted[i].prompt_token_ids for i in range(len(self.requests))]
        self.prompt_texts = [accepted[i].prompt_text for i in range(len(self.requests))]
        self.first_token_texts = [accepted[i].first_token_text or "" for i in range(len(self.requests))]

    async def batches(self):
        """Lists of (prompt index, Delta): each time, every delta that has arrived (one engine
        step's, or several when this stream fell behind, to be written at once), until every
        request finished (or the client left: then the requests are aborted and the iteration
        just ends); a Failed raises APIError after the deltas before it."""
        try:
            while self._open:
                try:
                    items = [await self._next()]
                except ClientGone:
                    logger.info("client disconnected: request aborted")
                    return
                while not self.queue.empty():
                    items.append(self.queue.get_nowait())
                deltas, error = [], None
                for index, event in items:
                    if isinstance(event, Delta):
                        deltas.append((index, event))
                        if self.times is not None:
                            count = len(event.token_ids) if self.count_generated else 0
                            self.times[index].tokens(event.index, count, event.finish_reason)
                    elif isinstance(event, Finished):
                        self._open.discard(index)
                        if self.times is not None:
                            self.times[index].end()
                    elif isinstance(event, Failed):
                        self._open.discard(index)
                        error = error or (APIError(503, str(event.error), "server_error")
                                          if isinstance(event.error, EngineStopped) else
                                          APIError(500, f"the request failed in the engine: {event.error}",
                                                   "server_error"))
                if deltas:
                    yield deltas
                if error is not None:
                    raise error
        finally:
            self.close()

    def close(self) -> None:
        for i in sorted(self._open):
            self.engine.abort(self.requests[i])
            if self.times is not None and i in self._accepted:
                self.times[i].end("abort")
        self._open.clear()


def sse(data) -> str:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


async def _flat(run: Run):
    """(prompt index, Delta) one at a time (a JSON response gathers them all anyway)."""
    async for batch in run.batches():
        for item in batch:
            yield item


class Chunks:
    """The server-sent events of one stream: OpenAI's chunk objects (the head's fields, one
    choice, the usage when asked), the head encoded once (a chunk is written for every token of
    every stream, so its JSON is on the server's hottest path)."""

    def __init__(self, head: dict, body, prompt_tokens: int):
        self.head, self.prompt_tokens, self.continuous = head, prompt_tokens, body.continuous_usage
        self._prefix = "data: " + json.dumps(head)[:-1] + ', "choices": ['  # (json.dumps of a dict ends in "}")
        self._suffix = '], "usage": null}\n\n' if body.include_usage else "]}\n\n"

    def choice(self, choice: dict, tokens: int) -> str:
        """A chunk of one choice; `tokens`: the completion tokens so far (continuous usage)."""
        if self.continuous:
            return sse({**self.head, "choices": [choice], "usage": usage(self.prompt_tokens, tokens)})
        return self._prefix + json.dumps(choice) + self._suffix

    def usage(self, tokens: int) -> str:
        """The last chunk of a stream that asked for usage: no choices."""
        return sse({**self.head, "choices": [], "usage": usage(self.prompt_tokens, tokens)})


# ---------------------------------------------------------------------------- the app
class OpenAIServer:
    """The routes' logic over one engine: an EngineProcess (the server's) or an EngineLoop."""

    def __init__(self, engine: EngineProcess | EngineLoop, served_model_name: str):
        self.engine, self.name = engine, served_model_name
        self.created = int(time.time())
        self.metrics = ServerMetrics(served_model_name, engine)

    @property
    def defaults(self) -> dict:
        """generation_config.json's sampling defaults (known once the engine has started)."""
        return self.engine.info.generation_defaults

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise APIError(404, f"The model `{model}` does not exist (this server serves `{self.name}`).",
                           param="model", code="model_not_found")

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model(self, model_id: str) -> dict:
        """GET /v1/models/{model_id} (the client's models.retrieve)."""
        self.check_model(model_id)
        return self.model_card()

    def model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "nano-vllm",
                "max_model_len": self.engine.info.max_model_len}

    async def tokenize(self, body: TokenizeRequest, http: Request) -> dict:
        """vLLM's POST /tokenize: {count, max_model_len, tokens}. The engine's own tokenizer (and
        chat template) does it, in the engine process, between steps; nothing is generated."""
        self.check_model(body.model)
        try:
            body.check()
        except ValueError as e:
            raise bad_request(e) from None
        if body.prompt in ("", []):  # (as vLLM: nothing to tokenize, not an error)
            return {"count": 0, "max_model_len": self.engine.info.max_model_len, "tokens": []}
        prompt = body.prompt if body.messages is None else \
            ChatPrompt([m.as_template_message() for m in body.messages], dict(body.chat_template_kwargs or {}))
        run = await self._tokenize_only(prompt, http, want_text=False)
        ids = run.prompt_ids[0]
        return {"count": len(ids), "max_model_len": self.engine.info.max_model_len, "tokens": ids}

    async def detokenize(self, body: DetokenizeRequest, http: Request) -> dict:
        """vLLM's POST /detokenize: {prompt}, the text of `tokens` (400 for an id outside the
        vocabulary)."""
        self.check_model(body.model)
        if not body.tokens:
            return {"prompt": ""}
        run = await self._tokenize_only(body.tokens, http, want_text=True)
        return {"prompt": run.prompt_texts[0] or ""}

    async def _tokenize_only(self, prompt, http: Request, want_text: bool) -> Run:
        run = Run(self.engine, http, lambda sink: [EngineRequest(prompt, None, sink(0), want_prompt_text=want_text,
                                                                 tokenize_only=True)])
        await run.start()
        async for _ in run.batches():  # (none: it ends at the request's Finished)
            pass
        return run

    def metrics_text(self) -> Response:
        """GET /metrics: Prometheus's text format (server_metrics.py)."""
        return Response(self.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    def health(self) -> JSONResponse:
        engine = self.engine
        ok = engine.running
        body = {"status": "ok" if ok else "unavailable"}
        if engine.stats is not None:
            body.update(dataclasses.asdict(engine.stats))
        return JSONResponse(body, status_code=200 if ok else 503)

    async def completions(self, body: CompletionRequest, http: Request):
        self.check_model(body.model)
        try:
            body.check()
            params = body.sampling_params(self.defaults, body.max_tokens or 1, body.logprobs, body.echo_logprobs)
            prompts = body.prompts()
        except (ValueError, TypeError, NotImplementedError) as e:
            raise bad_request(e) from None
        run = Run(self.engine, http, lambda sink: [EngineRequest(p, params, sink(i), want_prompt_text=bool(body.echo))
                                                  for i, p in enumerate(prompts)], watch_disconnect=not body.stream,
                  metrics=self.metrics, count_generated=body.generates)
        await run.start()
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.name}
        if body.stream:
            return StreamingResponse(self._completion_stream(run, body, head), media_type="text/event-stream",
                                     background=BackgroundTask(run.close))  # (a stream never started)
        return await self._completion_json(run, body, head)

    async def _completion_json(self, run: Run, body: CompletionRequest, head: dict) -> dict:
        n, gen = body.n, body.generates  # (gen False: echo with max_tokens=0, its one token not returned)
        texts, choices, generated = {}, {}, {}
        prompt_lps: dict[int, list] = {}  # prompt index -> its prompt logprobs (the first delta's)
        for pi, prompt_text in enumerate(run.prompt_texts):
            for j in range(n):
                texts[pi * n + j] = [prompt_text] if body.echo else []
                generated[pi * n + j] = []
                choices[pi * n + j] = {"index": pi * n + j, "text": "", "logprobs": None, "finish_reason": None,
                                       "stop_reason": None}
                if body.return_token_ids:
                    choices[pi * n + j].update(prompt_token_ids=run.prompt_ids[pi], token_ids=[])
        tokens = 0
        async for pi, d in _flat(run):
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

    async def _completion_stream(self, run: Run, body: CompletionRequest, head: dict):
        n, tokens, lps = body.n, 0, {}
        chunks = Chunks(head, body, sum(map(len, run.prompt_ids)))

        def choice(index, text, logprobs=None, finish=None, stop=None, token_ids=()):
            c = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop}
            if body.return_token_ids:
                c["token_ids"] = list(token_ids)
            return chunks.choice(c, tokens)

        try:
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
        except APIError as e:
            yield sse(error_body(e.message, e.type, e.param, e.code))
        finally:
            run.close()  # (closed at its first chunk, before batches() began: abort here)
        yield sse("[DONE]")

    async def chat(self, body: ChatCompletionRequest, http: Request):
        self.check_model(body.model)
        try:
            body.check()
            params = body.sampling_params(self.defaults, body.output_limit, body.num_logprobs)
            prompt = ChatPrompt([m.as_template_message() for m in body.messages], dict(body.chat_template_kwargs or {}))
        except (ValueError, TypeError, NotImplementedError) as e:
            raise bad_request(e) from None
        run = Run(self.engine, http, lambda sink: [EngineRequest(prompt, params, sink(0),
                                                                 fill_max_tokens=body.output_limit is None)],
                  watch_disconnect=not body.stream, metrics=self.metrics)
        await run.start()
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.name}
        if body.stream:
            head["object"] = "chat.completion.chunk"
            return StreamingResponse(self._chat_stream(run, body, head), media_type="text/event-stream",
                                     background=BackgroundTask(run.close))
        return await self._chat_json(run, body, head)

    async def _chat_json(self, run: Run, body: ChatCompletionRequest, head: dict) -> dict:
        k = body.num_logprobs
        choices = [{"index": j, "message": {"role": "assistant", "content": ""},
                    "logprobs": {"content": []} if k is not None else None, "finish_reason": None, "stop_reason": None}
                   for j in range(body.n)]
        texts = [[] for _ in range(body.n)]
        if body.return_token_ids:
            for c in choices:
                c.update(prompt_token_ids=run.prompt_ids[0], token_ids=[])
        tokens, prompt_lps = 0, None
        async for _, d in _flat(run):
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
            c["message"]["content"] = "".join(t)
        out = {**head, "choices": choices, "usage": usage(len(run.prompt_ids[0]), tokens)}
        if body.prompt_logprobs is not None:  # (vLLM's place for them: the response, not a choice)
            out["prompt_logprobs"] = prompt_logprobs_json(prompt_lps, body.prompt_logprobs)
        return out

    async def _chat_stream(self, run: Run, body: ChatCompletionRequest, head: dict):
        k, tokens = body.num_logprobs, 0
        chunks = Chunks(head, body, len(run.prompt_ids[0]))

        def choice(index, delta, logprobs=None, finish=None, stop=None, token_ids=()):
            c = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            if finish is not None:
                c["stop_reason"] = stop
            if body.return_token_ids:
                c["token_ids"] = list(token_ids)
            return chunks.choice(c, tokens)

        try:
            yield "".join(choice(j, {"role": "assistant", "content": ""}) for j in range(body.n))
            async for batch in run.batches():
                parts = []
                for _, d in batch:
                    tokens += len(d.token_ids)
                    logprobs = {"content": chat_logprobs(d.logprobs or [], k)} if k is not None else None
                    if d.text or d.finish_reason is not None or logprobs is not None or body.return_token_ids:
                        parts.append(choice(d.index, {"content": d.text} if d.text else {}, logprobs, d.finish_reason,
                                            d.stop_reason, d.token_ids))
                if parts:
                    yield "".join(parts)
            if body.include_usage:
                yield chunks.usage(tokens)
        except APIError as e:
            yield sse(error_body(e.message, e.type, e.param, e.code))
        finally:
            run.close()  # (closed at its first chunk, before batches() began: abort here)
        yield sse("[DONE]")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        param = param or (loc[0] if loc else None)
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "invalid request", param


class APIKeyGuard:
    """ASGI middleware: an HTTP request to any path but OPEN_PATHS whose `Authorization` header is
    not `Bearer <api_key>` gets 401 (OpenAI's error JSON) before anything reads its body. Plain
    ASGI rather than Starlette's BaseHTTPMiddleware, which would wrap every streamed response."""

    OPEN_PATHS = frozenset({"/health", "/metrics"})

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode("utf-8")

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.OPEN_PATHS and not self._allowed(scope):
            await APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>` with the "
                                "server's --api-key", code="invalid_api_key").response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope) -> bool:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, given = header.partition(b" ")
        # (the header's raw bytes against the key's UTF-8; compare_digest: the time taken does not
        # tell how much of a guessed key was right)
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.key)


def create_app(engine: EngineProcess | EngineLoop, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (an EngineProcess started already, or an EngineLoop);
    its lifespan hands the engine's events to the app's event loop (call_soon_threadsafe: one
    hop per engine step), starts the engine if it has not started, and stops it. `api_key`:
    every route but /health and /metrics wants it as a bearer token."""
    if api_key is not None and (not api_key.strip() or api_key != api_key.strip()):
        raise ValueError("api_key must not be empty or begin or end with whitespace (None: no key)")
    server = OpenAIServer(engine, served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop = asyncio.get_running_loop()

        def dispatch(items):
            with contextlib.suppress(RuntimeError):  # the event loop has closed: nobody is listening
                loop.call_soon_threadsafe(call_sinks, items)

        engine.dispatch = dispatch
        if not engine.running:
            engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="nano-vllm", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind, code=exc.status_code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        logger.exception("internal error")
        return JSONResponse(error_body(f"internal error: {exc!r}", "server_error"), status_code=500)

    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics_text)
    app.get("/v1/models")(server.models)
    app.get("/v1/models/{model_id:path}")(server.model)
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat)
    app.post("/tokenize")(server.tokenize)
    app.post("/detokenize")(server.detokenize)
    if api_key is not None:  # (FastAPI's /docs and /openapi.json included)
        app.add_middleware(APIKeyGuard, api_key=api_key)
    return app


# ---------------------------------------------------------------------------- the command line
# Help for each LLM option (README's option table); an option without an entry here still gets
# its flag, with a pointer to the README.
OPTION_HELP = {
    "tensor_parallel_size": "GPUs to split the model over",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step; longer prompts are prefilled in chunks",
    "max_model_len": "longest prompt + output (clamped to the model's max_position_embeddings)",
    "gpu_memory_utilization": "share of the GPU this engine may use",
    "kvcache_block_size": "tokens per KV block (a power of two >= 16)",
    "num_kvcache_blocks": "> 0: exactly that many KV blocks (else sized from memory)",
    "enforce_eager": "no CUDA graphs",
    "enable_prefix_caching": "reuse KV blocks of identical prompt prefixes",
    "device": "'cuda' or 'cpu' (default: cuda when available)",
    "dtype": "bfloat16 / float16 / float32 (default: the checkpoint's on CUDA, float32 on CPU)",
    "load_format": "'auto' or 'dummy' (random weights from config.json)",
    "seed": "seeds requests that have no seed of their own",
    "skip_tokenizer_init": "no tokenizer: prompts must be token ids, text is empty",
    "attention_backend": "force 'flash_attn', 'triton' or 'torch'",
    "custom_all_reduce": "fused symmetric-memory all-reduces under tensor parallelism",
    "tokenizer": "a different tokenizer folder (or Hub id) than the model's",
    "tokenizer_mode": "'auto' or 'slow'",
    "trust_remote_code": "passed to transformers when loading the tokenizer",
    "revision": "the Hub revision of a model or tokenizer given as a Hub id",
    "max_logprobs": "the most logprobs a request may ask for (-1: the whole vocabulary)",
    "generation_config": "default sampling parameters: 'auto' (the model's), 'vllm' (none) or a folder",
    "kv_cache_dtype": "'auto' or 'fp8'",
    "calculate_kv_scales": "calibrate the FP8 KV cache's scales on the first prefill",
    "quantization": "None or 'fp8' (FP8 checkpoints are detected by themselves)",
    "mixed_steps": "decode rows ride along with prompt chunks in one step (the server's default: on)",
    "max_prefill_graph_tokens": "prefill-shaped steps of up to this many tokens replay piecewise CUDA graphs (0: none)",
}
SERVER_DEFAULTS = {"mixed_steps": True}


def _flag_type(hint):
    """How a flag's string becomes the option's value, from the Config field's type."""
    kinds = [k for k in (typing.get_args(hint) or (hint,)) if k is not type(None)]
    if str in kinds or not kinds:
        return str
    for kind in (int, float):
        if kind in kinds:
            return kind
    return json.loads  # anything else (a list, a dict) as JSON


def config_fields() -> dict[str, tuple[object, object]]:
    """The LLM options but `model`: name -> (type, default) (Config.option_names)."""
    return Config.option_names()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m nanovllm.serve", description="An OpenAI-compatible server "
                                     "on nano-vllm's engine.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("model", help="a local checkpoint folder (or a Hub id when online)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
    parser.add_argument("--served-model-name", default=None, help="the model's name in the API (default: MODEL)")
    parser.add_argument("--api-key", default=os.environ.get("NANOVLLM_API_KEY") or None,
                        help="clients must send `Authorization: Bearer KEY` (every route but /health and /metrics); "
                             "default: $NANOVLLM_API_KEY, else no key")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--step-log", default=None, metavar="PATH",
                        help="write one JSON line per engine step to PATH (its kind, tokens, rows, when it ended, "
                             "how long the host waited for it): where serving latency goes")
    parser.add_argument("--shutdown-timeout", type=float, default=5.0,
                        help="seconds open responses may run on after SIGTERM before they are cancelled")
    llm = parser.add_argument_group("LLM options (nanovllm.LLM's keyword arguments)")
    for name, (hint, default) in config_fields().items():
        default = SERVER_DEFAULTS.get(name, default)
        text = OPTION_HELP.get(name, f"LLM option {name} (see docs/api.md)") + f" [default: {default!r}]"
        flag = "--" + name.replace("_", "-")
        if hint is bool:
            llm.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                             help=text)
        else:
            llm.add_argument(flag, dest=name, type=_flag_type(hint), default=argparse.SUPPRESS,
                             help=text)
    return parser


def llm_options(args: argparse.Namespace) -> dict:
    """The LLM keyword arguments the flags give (the server's defaults for those not given)."""
    names = set(config_fields())
    options = {k: v for k, v in vars(args).items() if k in names}
    return {**SERVER_DEFAULTS, **options}


def listen_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which on shutdown (SIGTERM) lets open responses run for the grace
    period and then ends the requests still running: their streams get an error event and
    `data: [DONE]` (a clean end) instead of a connection cut by the task's cancellation."""

    def __init__(self, config: uvicorn.Config, openai_server: OpenAIServer, grace_s: float):
        super().__init__(config)
        self.openai_server, self.grace_s = openai_server, grace_s

    async def shutdown(self, sockets=None):
        # (a moment before uvicorn's own deadline, so that the error events still go out)
        asyncio.get_running_loop().call_later(max(0.0, self.grace_s - 1.0), self.openai_server.engine.abort_all)
        await super().shutdown(sockets)


class ServerProcess:
    """`python -m nanovllm.serve MODEL ARGS... --port 0` as a subprocess on 127.0.0.1, for
    tests and benchmarks: started and healthy (GET /health) within `timeout` seconds, else a
    RuntimeError with the end of its log; `url` is its base URL ("http://127.0.0.1:PORT").
    `stop()` sends SIGTERM and returns the exit code (SIGKILL after `timeout`). A context
    manager. Standard library only."""

    def __init__(self, model: str, args: list[str] = (), timeout: float = 120.0, cwd: str | None = None,
                 env: dict | None = None):
        import collections
        import subprocess
        import threading

        self.log: collections.deque[str] = collections.deque(maxlen=400)
        self.proc = subprocess.Popen([sys.executable, "-m", "nanovllm.serve", model, "--host", "127.0.0.1",
                                      "--port", "0", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=cwd, env=env)
        self._port = threading.Event()
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.stop(10)
            raise

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line.rstrip())
            if not self._port.is_set() and line.startswith("nanovllm.serve.server: ") and " on http://" in line:
                self.url = line.rsplit(" on ", 1)[1].strip()
                self._port.set()

    def _wait_healthy(self, timeout: float) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n" + "\n".join(self.log))
            if self._port.wait(0.1):
                try:
                    with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                        if r.status == 200:
                            return
                except OSError:
                    pass
        raise RuntimeError(f"the server was not healthy within {timeout} s:\n" + "\n".join(self.log))

    def stop(self, timeout: float = 30.0) -> int:
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    options = llm_options(args)
    if wants_data_parallel(options):  # before any replica starts, not when the app does
        parser.error(SINGLE_ENGINE_ONLY)
    if args.api_key is not None:
        args.api_key = args.api_key.strip()  # (a key read from a file often ends in a newline)
        if not args.api_key:
            parser.error("--api-key must not be empty (leave it out for no key)")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = EngineProcess(args.model, options, log_level=args.log_level.upper(), step_log=args.step_log)
    engine.start()  # the model loads in the engine's process (its error, if it cannot, is raised here)
    try:
        sock = listen_socket(args.host, args.port)
        host, port = sock.getsockname()[:2]
        app = create_app(engine, args.served_model_name or args.model, args.api_key)
        config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_timeout)
        server = DrainingServer(config, app.state.server, args.shutdown_timeout)
        # uvicorn takes SIGINT / SIGTERM while it runs and, once it has shut down, raises the
        # signal again under the handler that was there before: make that one a no-op, so a
        # SIGTERM ends the process normally (exit 0) after the clean shutdown below.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        print(f"nanovllm.serve.server: {args.served_model_name or args.model} on http://{host}:{port}", flush=True)
        server.run(sockets=[sock])
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
