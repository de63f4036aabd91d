"""The FastAPI app of the OpenAI-compatible server: its routes (routes.py), its errors as
OpenAI's JSON, its middleware (guards.py), and the lifespan that joins it to the engine.

Routes: GET /v1/models (and /v1/models/{id}), POST /v1/completions, POST /v1/chat/completions
(`stream: true` as server-sent events in OpenAI's chunk format, ending with `data: [DONE]`; a
usage chunk last when `stream_options.include_usage`), vLLM's POST /tokenize and /detokenize,
GET /health (the engine's liveness, free KV blocks and queues), GET /metrics (Prometheus, vLLM's
metric names: metrics.py); with --enable-lora, vLLM's POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (adapters are served as models: lora_modules.py). With an API key every route but /health and /metrics wants
`Authorization: Bearer KEY` (401 without it). Errors are OpenAI's JSON ({"error": {"message",
"type", "param", "code"}}): 400 for a bad request, 401 for a missing or wrong key, 404 for an
unknown model or route, 408 / 413 for a body too slow / too large, 500 when the engine failed,
503 once it stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm.serve.async_engine import call_sinks
from nanovllm.serve.errors import APIError
from nanovllm.serve.guards import APIKeyGuard, BodyLimits, error_response
from nanovllm.serve.routes import OpenAIServer, ServeOptions

logger = logging.getLogger(__name__)


def create_app(engine, served_model_name: str, api_key: str | None = None, preparer=None,
               options: ServeOptions = ServeOptions()):
    """The FastAPI app serving `engine` (an EngineProcess started already, or an EngineLoop);
    its lifespan hands the engine's events to the app's event loop (call_soon_threadsafe: one
    hop per engine step), starts the engine if it has not started, and stops it. `api_key`:
    every route but /health and /metrics wants it as a bearer token. `preparer`: a started
    PreparerPool that prepares requests off the engine (None: the engine prepares them)."""
    if api_key is not None and (not api_key.strip() or api_key != api_key.strip()):
        raise ValueError("api_key must not be empty or begin or end with whitespace (None: no key)")
    server = OpenAIServer(engine, served_model_name, preparer, options)

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
    _add_error_handlers(app)
    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics_text)
    app.get("/v1/models")(server.models)
    app.get("/v1/models/{model_id:path}")(server.model)
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat)
    app.post("/tokenize")(server.tokenize)
    app.post("/detokenize")(server.detokenize)
    app.post("/v1/load_lora_adapter")(server.load_lora_adapter)
    app.post("/v1/unload_lora_adapter")(server.unload_lora_adapter)
    app.add_middleware(BodyLimits, max_bytes=options.max_body_bytes, timeout_s=options.body_timeout_s)
    if api_key is not None:  # (outermost: the key before the body; FastAPI's /docs and /openapi.json included)
        app.add_middleware(APIKeyGuard, api_key=api_key)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's JSON, its message capped (errors.capped)."""

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(APIError(exc.status_code, str(exc.detail), kind, code=exc.status_code))

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        logger.exception("internal error")
        return error_response(APIError(500, f"internal error: {exc!r}", "server_error"))


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        param = param or (loc[0] if loc else None)
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "invalid request", param
