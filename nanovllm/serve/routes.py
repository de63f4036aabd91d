"""The routes' logic over one engine (`OpenAIServer`): models, tokenize / detokenize, health,
metrics; completions and chat are in their own modules (completions.py, chat.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from nanovllm.serve.async_engine import EngineRequest
from nanovllm.serve.chat import chat_prompt, create_chat_completion
from nanovllm.serve.completions import create_completion
from nanovllm.serve.errors import APIError, bad_request
from nanovllm.serve.limits import check_prompt
from nanovllm.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from nanovllm.serve.lora_modules import LoraModules
from nanovllm.serve.metrics import ServerMetrics
from nanovllm.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     LoadLoraAdapterRequest, TokenizeRequest, UnloadLoraAdapterRequest)
from nanovllm.serve.run import Run


@dataclass(frozen=True)
class ServeOptions:
    """The server's policies. `trust_request_chat_template`: render chat templates that requests
    send (code the server runs: off unless its operator trusts the clients).
    `engine_stall_s`: /health fails once the engine has been silent, or has made no progress
    with requests in it, this long. `max_body_bytes`, `body_timeout_s`: the most a request's
    body may hold, and the time it may take to arrive (guards.BodyLimits)."""

    trust_request_chat_template: bool = False
    engine_stall_s: float = 60.0
    max_body_bytes: int = 16 << 20
    body_timeout_s: float = 30.0
    tool_call_parser: str = "hermes"  # how tool_choice "auto" reads calls (features/tools/parsers.py)
    reasoning_parser: str | None = None  # "qwen3": <think> ... </think> into reasoning_content
    enable_lora: bool = False  # the engine takes adapters: --lora-modules and the load / unload routes
    max_lora_rank: int = 16
    lora_modules: tuple = ()  # (name, path) of each adapter served from the start


class OpenAIServer:
    """The routes' logic over one engine: an EngineProcess (the server's) or an EngineLoop;
    `preparer`: a PreparerPool that prepares requests off the engine (None: the engine does)."""

    def __init__(self, engine, served_model_name: str, preparer=None, options: ServeOptions = ServeOptions()):
        self.engine, self.name, self.preparer, self.options = engine, served_model_name, preparer, options
        self.created = int(time.time())
        self.metrics = ServerMetrics(served_model_name, engine)
        self.lora = LoraModules(served_model_name, options.enable_lora, list(options.lora_modules),
                                options.max_lora_rank)

    @property
    def defaults(self) -> dict:
        """generation_config.json's sampling defaults (known once the engine has started)."""
        return self.engine.info.generation_defaults

    def check_model(self, model: str | None):
        """The LoRARequest of the adapter `model` names, or None for the base model (404 for a
        name the server does not serve)."""
        try:
            return self.lora.request_for(model)
        except KeyError:
            served = ", ".join(f"`{n}`" for n in [self.name, *self.lora.adapters])
            raise APIError(404, f"The model `{model}` does not exist (this server serves {served}).",
                           param="model", code="model_not_found") from None

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card(), *self.lora.cards(self.created, self.max_model_len)]}

    def model(self, model_id: str) -> dict:
        """GET /v1/models/{model_id} (the client's models.retrieve)."""
        self.check_model(model_id)
        return next(card for card in self.models()["data"] if card["id"] == model_id)

    @property
    def max_model_len(self) -> int:
        return self.engine.info.max_model_len

    def model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "nano-vllm",
                "max_model_len": self.max_model_len}

    def load_lora_adapter(self, body: LoadLoraAdapterRequest) -> PlainTextResponse:
        """POST /v1/load_lora_adapter (400 naming what is wrong: LoRA off, a name taken, no adapter)."""
        try:
            self.lora.load(body.lora_name, body.lora_path)
        except (ValueError, FileNotFoundError) as e:
            raise bad_request(e) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    def unload_lora_adapter(self, body: UnloadLoraAdapterRequest) -> PlainTextResponse:
        """POST /v1/unload_lora_adapter (404 for an adapter not loaded). Requests running on it finish."""
        try:
            self.lora.unload(body.lora_name)
        except KeyError as e:
            raise APIError(404, e.args[0], param="lora_name", code="model_not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def completions(self, body: CompletionRequest, http: Request):
        return await create_completion(self, body, http)

    async def chat(self, body: ChatCompletionRequest, http: Request):
        return await create_chat_completion(self, body, http)

    async def tokenize(self, body: TokenizeRequest, http: Request) -> dict:
        """vLLM's POST /tokenize: {count, max_model_len, tokens}. The engine's own tokenizer and
        chat template do it (in a preparer worker, or between the engine's steps); nothing is
        generated."""
        self.check_model(body.model)
        max_len = self.engine.info.max_model_len
        try:
            body.check()
            if body.messages is None:
                check_prompt("prompt", body.prompt, max_len)
        except ValueError as e:
            raise bad_request(e) from None
        if body.prompt in ("", []):  # (as vLLM: nothing to tokenize, not an error)
            return {"count": 0, "max_model_len": max_len, "tokens": []}
        prompt = body.prompt
        if body.messages is not None:
            try:
                prompt = chat_prompt(body.messages, body.chat_template_kwargs, body.chat_template,
                                     self.options.trust_request_chat_template, max_len)
            except ValueError as e:
                raise bad_request(e) from None
        run = await self._tokenize_only(prompt, http, want_text=False)
        ids = run.prompt_ids[0]
        return {"count": len(ids), "max_model_len": max_len, "tokens": ids}

    async def detokenize(self, body: DetokenizeRequest, http: Request) -> dict:
        """vLLM's POST /detokenize: {prompt}, the text of `tokens` (400 for an id outside the
        vocabulary)."""
        self.check_model(body.model)
        if not body.tokens:
            return {"prompt": ""}
        run = await self._tokenize_only(body.tokens, http, want_text=True)
        return {"prompt": run.prompt_texts[0] or ""}

    async def _tokenize_only(self, prompt, http: Request, want_text: bool) -> Run:
        run = Run(self.engine, self.preparer, http,
                  lambda sink: [EngineRequest(prompt, None, sink(0), want_prompt_text=want_text, tokenize_only=True)])
        await run.start()
        async for _ in run.batches():  # (none: it ends at the request's Finished)
            pass
        return run

    def metrics_text(self) -> Response:
        """GET /metrics: Prometheus's text format (metrics.py)."""
        return Response(self.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    def health(self) -> JSONResponse:
        """GET /health: 200 while the engine runs and keeps up; 503 once it stopped, or has been
        silent (a stopped or frozen process) or made no progress with requests in it (a hung
        step) for longer than the server's --engine-stall-timeout; its KV blocks and queues."""
        engine, stats, now = self.engine, self.engine.stats, time.monotonic()
        silent = now - engine.heard_at
        stalled = now - stats.progress_at if stats is not None and stats.busy else 0.0
        limit = self.options.engine_stall_s
        problem = None
        if not engine.running:
            problem = "the engine has stopped"
        elif silent > limit:
            problem = f"the engine process has not answered for {silent:.1f} s"
        elif stalled > limit:
            problem = f"the engine has made no progress for {stalled:.1f} s with requests in it"
        body = {"status": "ok" if problem is None else "unavailable"}
        if problem is not None:
            body["reason"] = problem
        if stats is not None:
            body.update(num_kv_blocks=stats.num_kv_blocks, free_kv_blocks=stats.free_kv_blocks, running=stats.running,
                        waiting=stats.waiting, requests=stats.requests, steps=stats.steps,
                        seconds_without_progress=round(stalled, 3))
        return JSONResponse(body, status_code=200 if problem is None else 503)
