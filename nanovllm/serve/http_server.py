"""The HTTP server under the app: uvicorn, with the bounds that keep slow or idle clients from
holding connections (a deadline for each request's head, keep-alive, a concurrency limit, the
header size), a drain on shutdown, and the exit when the engine dies.

uvicorn times out idle keep-alive connections but not a request's head that is sent in part:
`head_deadline_protocol` adds that to its HTTP protocol (a connection whose next request's head
is not complete within the deadline, from its opening or from its last response, is closed).
The body's bound is the app's (guards.BodyLimits).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 << 10  # the most a request's head may hold (h11's limit; httptools has its own)


def listen_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def raise_open_file_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit (every connection is a
    file); returns the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            logger.warning("could not raise the open-file limit above %d", soft)
    return soft


def _base_protocol():
    """The HTTP protocol class uvicorn's "auto" picks: httptools if installed, else h11."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # (httptools is optional)
    except ImportError:
        return H11Protocol
    return HttpToolsProtocol


def head_deadline_protocol(deadline_s: float):
    """uvicorn's HTTP protocol class with a deadline on each request's head."""

    class HeadDeadline(_base_protocol()):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm_head_deadline()

        def on_response_complete(self):
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head_deadline()

        def _arm_head_deadline(self):
            waiting_after = self.cycle  # (a new request's head, once complete, makes a new cycle)

            def expire():
                if self.cycle is waiting_after and not self.transport.is_closing():
                    self.transport.close()

            self.loop.call_later(deadline_s, expire)

    return HeadDeadline


def uvicorn_config(app, log_level: str, shutdown_timeout: float, head_timeout: float, keep_alive: float,
                   limit_concurrency: int | None) -> uvicorn.Config:
    """uvicorn's settings for the server: the head deadline, keep-alive, the concurrency limit
    (None: half the open-file limit; past it, new requests get 503), the header size."""
    files = raise_open_file_limit()
    if limit_concurrency is None:
        limit_concurrency = max(64, files // 2)
    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout,
                          http=head_deadline_protocol(head_timeout), timeout_keep_alive=keep_alive,
                          limit_concurrency=limit_concurrency, h11_max_incomplete_event_size=MAX_HEADER_BYTES)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which on shutdown (SIGTERM) lets open responses run for the grace
    period and then ends the requests still running: their streams get an error event and
    `data: [DONE]` (a clean end) instead of a connection cut by the task's cancellation.
    `engine_died(error)` (any thread) makes it shut down, and `died` says so afterwards."""

    def __init__(self, config: uvicorn.Config, engine, grace_s: float):
        super().__init__(config)
        self.engine, self.grace_s = engine, grace_s
        self.died: BaseException | None = None

    def engine_died(self, error: BaseException) -> None:
        logger.error("the engine died (%s): the server exits so that a supervisor can restart it", error)
        self.died = error
        self.should_exit = True  # (uvicorn's main loop reads it every tick)

    async def shutdown(self, sockets=None):
        # (a moment before uvicorn's own deadline, so that the error events still go out)
        asyncio.get_running_loop().call_later(max(0.0, self.grace_s - 1.0), self.engine.abort_all)
        await super().shutdown(sockets)
