"""ASGI middleware that stands before the routes: the API key, and the bounds on a request's
body (its size and how long it may take to arrive)."""

from __future__ import annotations

import asyncio
import hmac

from fastapi.responses import JSONResponse

from nanovllm.serve.errors import APIError, ClientGone
from nanovllm.serve.protocol import error_body


def error_response(e: APIError, close: bool = False) -> JSONResponse:
    """OpenAI's error JSON of `e` (`close`: and the connection closes after it)."""
    headers = {"connection": "close"} if close else None
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=headers)


class APIKeyGuard:
    """ASGI middleware: an HTTP request to any path but OPEN_PATHS whose `Authorization` header is
    not `Bearer <api_key>` gets 401 (OpenAI's error JSON) before anything reads its body. Plain
    ASGI rather than Starlette's BaseHTTPMiddleware, which would wrap every streamed response."""

    OPEN_PATHS = frozenset({"/health", "/metrics"})

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode("utf-8")

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.OPEN_PATHS and not self._allowed(scope):
            await error_response(APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>` "
                                               "with the server's --api-key", code="invalid_api_key"))(
                scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope) -> bool:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, given = header.partition(b" ")
        # (the header's raw bytes against the key's UTF-8; compare_digest: the time taken does not
        # tell how much of a guessed key was right)
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.key)


class _TooLarge(Exception):
    pass


class BodyLimits:
    """ASGI middleware: the body of a request must hold at most `max_bytes` (413) and arrive
    within `timeout_s` seconds of the request's head (408; a client that sends part of a body
    and stops holds a connection no longer). The body is read here, whole, before the route
    sees it (the routes read it whole anyway); either error closes the connection."""

    def __init__(self, app, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        try:
            body = await asyncio.wait_for(self._read(scope, receive), self.timeout_s)
        except _TooLarge:
            error = APIError(413, f"the request body is larger than the server's limit of {self.max_bytes} bytes "
                                  "(--max-request-body-bytes)")
        except asyncio.TimeoutError:
            error = APIError(408, f"the request body did not arrive within {self.timeout_s} s "
                                  "(--request-body-timeout)")
        except ClientGone:
            return
        else:
            await self.app(scope, _replay(body, receive), send)
            return
        await error_response(error, close=True)(scope, receive, send)

    async def _read(self, scope, receive) -> bytes:
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            raise _TooLarge()
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _TooLarge()
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


def _replay(body: bytes, receive):
    """A `receive` that gives the body read already, then what the connection says (a disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
