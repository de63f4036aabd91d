"""The server's engine in a process of its own, so that its Python never waits for the GIL.

In one process, the HTTP side (an asyncio thread formatting and writing one chunk per token per
stream) and the engine thread take turns on one GIL: every step waits for the chunks of the
last one. `EngineProcess` runs the `EngineLoop` (async_engine.py) in a spawned child
that builds the `LLM` itself; the parent keeps the requests and their sinks. Two pipes join them:

    parent -> child   ("add", [(request id, prompt, params, fill_max_tokens, want_prompt_text,
                               tokenize_only, Prepared or None)])  (a prepared one: no prompt, params)
                      ("abort", request id), ("abort_all", reason), ("stop", None)
    child -> parent   ("ready", EngineInfo, stats) or ("failed", exception) once, at start
                      ("events", stats, [(request id, event), ...])  one per loop iteration
                      ("stats", stats)                                 when only the stats changed
                      ("alive", stats)                                 every HEARTBEAT_S otherwise
                      ("stopped", error or None)                       the loop has ended

It has the loop's interface (`submit`, `abort`, `abort_all`, `stop`, `running`, `stats`, `error`,
`info`, a settable `dispatch`), so the server drives either. The child ignores SIGINT / SIGTERM
(the parent decides when it stops: "stop", or the command pipe closing when the parent dies).
`heard_at` says when the child last spoke (its heartbeat: a stopped or frozen process falls
silent), `on_death` is called when it ends without being told to.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import logging
import multiprocessing as mp
import signal
import threading
import time
from typing import Callable

from nanovllm.llm import LLM
from nanovllm.serve.async_engine import (EngineInfo, EngineLoop, EngineRequest, EngineStats, EngineStopped, Failed,
                                          Finished, call_sinks)
from nanovllm.serve.errors import picklable

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5  # how often an engine process with nothing else to say says it is alive


class EngineProcess:
    """`LLM(model, **options)` and its EngineLoop in a child process (see the module docstring).

    `start()` spawns it and returns once the model is loaded, raising the error the LLM raised if it
    could not be built (a ValueError for a bad option, ...). `dispatch(items)` receives
    [(EngineRequest, event), ...] on a reader thread of this process, one batch per engine loop
    iteration, in order. `stop()` ends every request (each gets Failed), shuts the LLM down and
    joins the child. `on_death(error)`, called on the reader thread, hears of a child that died
    or whose loop failed (not of one stopped by `stop()`)."""

    def __init__(self, model: str, options: dict, dispatch: Callable[[list], None] = call_sinks,
                 log_level: str = "WARNING", step_log: str | None = None):
        self.model, self.options, self.dispatch, self.log_level = model, dict(options), dispatch, log_level
        self.step_log = step_log  # a file: one JSON line per engine step (StepTiming), for diagnosis
        self.info: EngineInfo | None = None
        self.stats: EngineStats | None = None
        self.error: BaseException | None = None
        self.on_death: Callable[[BaseException], None] | None = None
        self.heard_at = time.monotonic()
        self._stopping = False
        self._requests: dict[int, EngineRequest] = {}
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        # Held while requests are registered and while the reader fails those left at the end:
        # a request is either refused by submit() or failed by the reader, never forgotten.
        self._registry_lock = threading.Lock()
        self._proc = None
        self._commands = self._events = None
        self._reader: threading.Thread | None = None
        self._stopped = threading.Event()

    # ------------------------------------------------------------------ any thread
    @property
    def running(self) -> bool:
        return self._proc is not None and not self._stopped.is_set()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError("this engine process was started already")
        ctx = mp.get_context("spawn")
        commands_in, self._commands = ctx.Pipe(duplex=False)
        self._events, events_out = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_engine_main, name="nanovllm-engine", daemon=False,
                                 args=(self.model, self.options, commands_in, events_out, self.log_level,
                                       self.step_log))
        self._proc.start()
        commands_in.close()  # (the child's ends: closed here, so that either side sees the other go)
        events_out.close()
        try:
            kind, *rest = self._events.recv()
        except EOFError:
            self._proc.join(10)
            self._stopped.set()
            raise RuntimeError(f"the engine process exited while loading the model (exit code "
                               f"{self._proc.exitcode})") from None
        except BaseException:  # Ctrl-C while the model loads: the child ignores SIGINT, so end it here
            self._proc.kill()
            self._proc.join()
            self._stopped.set()
            raise
        if kind == "failed":
            self._proc.join(30)
            self._stopped.set()
            raise rest[0]
        self.info, self.stats = rest
        self.heard_at = time.monotonic()
        self._reader = threading.Thread(target=self._read, name="nanovllm-engine-events", daemon=True)
        self._reader.start()

    def submit(self, requests: list[EngineRequest]) -> None:
        """Queue requests, validated together in the child: all are added, or all get the same Failed."""
        with self._registry_lock:
            if not self.running:
                raise RuntimeError("the engine is not running" + (f" ({self.error!r})" if self.error else ""))
            batch = []
            for r in requests:
                r.request_id = next(self._ids)
                self._requests[r.request_id] = r
                ready = r.prepared is not None  # (then the child needs neither the prompt nor the params)
                batch.append((r.request_id, None if ready else r.prompt, None if ready else r.params,
                              r.fill_max_tokens, r.want_prompt_text, r.tokenize_only, r.prepared, r.lora_request))
        try:
            self._send(("add", batch))
        except BaseException:  # (a prompt or params that do not pickle): nothing was queued
            with self._registry_lock:
                for r in requests:
                    self._requests.pop(r.request_id, None)
            raise

    def abort(self, request: EngineRequest) -> None:
        """End `request` now (its blocks are freed in the child); no further events (idempotent)."""
        with self._registry_lock:
            known = self._requests.pop(getattr(request, "request_id", None), None) is not None
            request.aborted = request.done = True  # (call_sinks drops what the reader had in hand)
        if known:
            self._send(("abort", request.request_id))

    def abort_all(self, reason: str = "the server is shutting down") -> None:
        self._send(("abort_all", reason))

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort every request (each gets Failed), shut the LLM down and join the child (killed
        after `timeout` seconds)."""
        if self._proc is None:
            return
        self._stopping = True
        self._send(("stop", None))
        self._proc.join(timeout)
        if self._proc.is_alive():
            logger.error("the engine process did not stop within %s s: killing it", timeout)
            self._proc.kill()
            self._proc.join()
        if self._reader is not None:
            self._reader.join(timeout)
        self._stopped.set()

    # ------------------------------------------------------------------ this process
    def _send(self, message) -> None:
        with self._send_lock:
            try:
                self._commands.send(message)
            except (OSError, ValueError):  # the child is gone: the reader tells every request
                pass

    def _read(self) -> None:
        """The reader thread: events to their requests' sinks, until the child ends."""
        error = None
        try:
            while True:
                kind, *rest = self._events.recv()
                self.heard_at = time.monotonic()
                if kind == "events":
                    self.stats, batch = rest
                    self._deliver(batch)
                elif kind in ("stats", "alive"):
                    self.stats = rest[0]
                elif kind == "stopped":
                    error = rest[0]
                    break
        except EOFError:
            self._proc.join(10)
            error = RuntimeError(f"the engine process died (exit code {self._proc.exitcode})")
        except Exception as e:  # noqa: BLE001 (a message that did not unpickle: the link is unusable)
            logger.exception("lost the engine process's events")
            error = RuntimeError(f"lost the engine process's events: {e!r}")
        finally:
            with self._registry_lock:
                self.error = error
                self._stopped.set()
                left = list(self._requests.values())
                self._requests.clear()
            # Whatever the child could not finish itself (it died) fails here.
            failed = EngineStopped("the server is shutting down") if error is None else \
                RuntimeError(f"the engine failed: {error!r}")
            if left:
                self._dispatch([(r, Failed(failed)) for r in left])
            if not self._stopping and self.on_death is not None:
                self.on_death(error or RuntimeError("the engine process stopped by itself"))

    def _deliver(self, batch: list) -> None:
        items = []
        with self._registry_lock:  # (abort() may pop a request meanwhile, on another thread)
            for request_id, event in batch:
                r = self._requests.get(request_id)
                if r is None:
                    continue  # aborted here since the child sent it
                if isinstance(event, (Finished, Failed)):
                    del self._requests[request_id]
                    r.done = True
                items.append((r, event))
        if items:
            self._dispatch(items)

    def _dispatch(self, items: list) -> None:
        try:
            self.dispatch(items)
        except Exception:  # noqa: BLE001 (the receiving side is gone: nothing to tell it)
            logger.exception("could not hand out the engine's events")


# ---------------------------------------------------------------------------- the child
def _engine_main(model: str, options: dict, commands, events, log_level: str, step_log: str | None) -> None:
    """The child: build the LLM, run its EngineLoop, obey commands until "stop" or the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when the engine stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    lock = threading.Lock()

    def send(message) -> None:
        with lock:
            events.send(message)

    try:
        log = open(step_log, "w", buffering=1 << 16) if step_log else None
        llm = LLM(model, **options)
    except BaseException as e:  # noqa: BLE001 (the parent raises it)
        send(("failed", picklable(e)))
        return
    # What loading made (modules, tensors' Python objects, the tokenizer) lives as long as the
    # engine: frozen, a full collection while serving does not walk it (a pause every open stream
    # would feel).
    gc.collect()
    gc.freeze()
    if log is not None:
        llm.step_observers.append(lambda t: log.write(json.dumps(dataclasses.asdict(t)) + "\n"))
    child = _Child(llm, send)
    try:
        child.obey(commands)
    finally:
        child.loop.stop(timeout=None)
        llm.shutdown()
        if log is not None:
            log.close()
        send(("stopped", picklable(child.loop.error) if child.loop.error is not None else None))


class _Child:
    """The child's side: the EngineLoop, the requests it knows by id, and the heartbeat."""

    def __init__(self, llm: LLM, send: Callable[[object], None]):
        self.send = send
        self.requests: dict[int, EngineRequest] = {}
        self.loop = EngineLoop(llm, self._dispatch, on_stats=self._said(lambda stats: ("stats", stats)))
        self.said_at = time.monotonic()
        send(("ready", self.loop.info, self.loop.stats))

    def _said(self, message_of):
        def say(*args):
            self.said_at = time.monotonic()
            self.send(message_of(*args))
        return say

    def _dispatch(self, items) -> None:
        batch = []
        for r, event in items:
            if isinstance(event, Failed):
                event = Failed(picklable(event.error))
            batch.append((r.request_id, event))
            if r.done:
                self.requests.pop(r.request_id, None)
        self.said_at = time.monotonic()
        self.send(("events", self.loop.stats, batch))

    def obey(self, commands) -> None:
        """Run commands until "stop", the pipe closing or the loop ending; say "alive" when
        nothing was said for HEARTBEAT_S (this thread, not the loop's: it still speaks while a
        step runs, and falls silent only when the whole process does)."""
        self.loop.start()
        while self.loop.running:
            if time.monotonic() - self.said_at >= HEARTBEAT_S:
                self._said(lambda: ("alive", self.loop.stats))()
            if not commands.poll(HEARTBEAT_S):
                continue  # (and look again whether the loop is still running)
            try:
                kind, arg = commands.recv()
            except EOFError:
                return  # the server is gone
            if kind == "stop":
                return
            self._command(kind, arg)

    def _command(self, kind: str, arg) -> None:
        if kind == "add":
            batch = []
            for request_id, prompt, params, fill, want_text, tokenize_only, prepared, lora in arg:
                r = EngineRequest(prompt, params, None, fill_max_tokens=fill, want_prompt_text=want_text,
                                  tokenize_only=tokenize_only, prepared=prepared, lora_request=lora)
                r.request_id = request_id
                self.requests[request_id] = r
                batch.append(r)
            self.loop.submit(batch)
        elif kind == "abort":
            r = self.requests.pop(arg, None)
            if r is not None:
                self.loop.abort(r)
        elif kind == "abort_all":
            self.loop.abort_all(arg)
