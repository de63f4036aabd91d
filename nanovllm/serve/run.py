"""One HTTP request's engine requests (one per prompt): prepared, submitted, their events read
on the event loop, and aborted when the client leaves."""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request

from nanovllm.serve.async_engine import Accepted, Delta, EngineRequest, EngineStopped, Failed, Finished
from nanovllm.serve.errors import APIError, ClientGone, bad_request
from nanovllm.serve.metrics import ServerMetrics
from nanovllm.serve.preparation import is_small
from nanovllm.serve.preparer_pool import PrepareTimeout

logger = logging.getLogger(__name__)

# How often a request waiting for tokens checks that its client is still connected (seconds).
DISCONNECT_POLL_S = 0.5


def _engine_error(error: BaseException, where: str = "") -> APIError:
    if isinstance(error, (ValueError, TypeError, NotImplementedError)):
        return bad_request(error)
    if isinstance(error, EngineStopped):
        return APIError(503, str(error), "server_error")
    return APIError(500, f"{where}{error}", "server_error")


class Run:
    """The engine requests of one HTTP request (one per prompt) and their events, read on the
    event loop; leaving `batches()` early (a disconnect, a cancelled task) aborts them.
    `preparer`: where the requests are prepared first (a PreparerPool; None: by the engine).
    `watch_disconnect`: check the connection while waiting for events (a JSON response; a
    streaming response's task is cancelled by Starlette itself when its client goes). `metrics`:
    where its tokens and latencies are counted (None: nowhere); `count_generated` False: its
    generated tokens are not returned (echo with max_tokens=0), so not counted either."""

    def __init__(self, engine, preparer, http: Request, requests_of, watch_disconnect: bool = True,
                 metrics: ServerMetrics | None = None, count_generated: bool = True):
        self.engine, self.preparer, self.http, self.metrics = engine, preparer, http, metrics
        self.watch = watch_disconnect
        self.count_generated = count_generated
        self.queue: asyncio.Queue = asyncio.Queue()
        self.requests: list[EngineRequest] = requests_of(self._sink)
        self.times = [metrics.request() for _ in self.requests] if metrics is not None else None
        self.prompt_ids: list[list[int]] = []
        self.prompt_texts: list[str | None] = []
        self.first_token_texts: list[str] = []
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

    async def prepare(self) -> None:
        """Prepare the requests off the engine, unless all are small enough for the engine to
        prepare itself (preparation.is_small; nothing to do without a preparer): APIError 400 for
        a request the engine would refuse or whose preparation ran past the time limit."""
        if self.preparer is None or all(is_small(r) for r in self.requests):
            return
        try:
            prepared = await self.preparer.prepare(self.requests)
        except PrepareTimeout as e:
            raise APIError(400, f"preparing the request (its chat template, tokenizing) took longer than {e} s, "
                                "the server's --prepare-timeout") from None
        except Exception as e:  # noqa: BLE001 (preparation's error: the request's, or a dead worker)
            raise _engine_error(e, "could not prepare the request: ") from None
        for r, p in zip(self.requests, prepared):
            r.prepared = p

    async def start(self) -> None:
        """Prepare, submit, and wait until every prompt is accepted (APIError 400 if one is
        refused). Requests that only tokenize are done once prepared (the engine is not asked)."""
        await self.prepare()
        if all(r.prepared is not None and r.tokenize_only for r in self.requests):
            self._accept_all([Accepted(r.prepared.prompt_token_ids, r.prepared.prompt_text) for r in self.requests])
            self._open.clear()
            return
        try:
            self.engine.submit(self.requests)
        except RuntimeError:  # it stopped
            raise APIError(503, "the server is shutting down", "server_error") from None
        try:
            self._accept_all(await self._acceptances())
        except BaseException:
            self.close()
            raise

    async def _acceptances(self) -> list[Accepted]:
        accepted: dict[int, Accepted] = {}
        while len(accepted) < len(self.requests):
            try:
                index, event = await self._next(watch=True)  # (also: the engine stopping meanwhile)
            except ClientGone:
                raise APIError(400, "the client disconnected") from None
            if isinstance(event, Failed):
                self._open.clear()  # all of them were refused together
                raise _engine_error(event.error)
            accepted[index] = event
            self._accepted.add(index)
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(event.prompt_token_ids))
        return [accepted[i] for i in range(len(self.requests))]

    def _accept_all(self, accepted: list[Accepted]) -> None:
        self.prompt_ids = [a.prompt_token_ids for a in accepted]
        self.prompt_texts = [a.prompt_text for a in accepted]
        self.first_token_texts = [a.first_token_text or "" for a in accepted]

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
                deltas, error = self._sort(items)
                if deltas:
                    yield deltas
                if error is not None:
                    raise error
        finally:
            self.close()

    def _sort(self, items: list) -> tuple[list, APIError | None]:
        """The deltas among `items` (counted in the metrics), and the error of a Failed among them."""
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
                if error is None:
                    error = APIError(503, str(event.error), "server_error") if isinstance(event.error, EngineStopped) \
                        else APIError(500, f"the request failed in the engine: {event.error}", "server_error")
        return deltas, error

    def close(self) -> None:
        for i in sorted(self._open):
            self.engine.abort(self.requests[i])
            if self.times is not None and i in self._accepted:
                self.times[i].end("abort")
        self._open.clear()


async def flat(run: Run):
    """(prompt index, Delta) one at a time (a JSON response gathers them all anyway)."""
    async for batch in run.batches():
        for item in batch:
            yield item
