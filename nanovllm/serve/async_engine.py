"""The engine loop of a server: one thread owns an `LLM` and steps it while requests come and go.

Other threads (the server's) never touch the engine: they put commands (add these requests,
abort that one, stop) on a thread-safe queue that only the loop thread reads. The loop adds
requests (preparing those a server has not prepared already: preparation.py), runs `LLMEngine.step()` whenever there is work (and blocks on the queue when
there is none), and hands every request's events to its `sink`, through `dispatch`: once per
loop iteration, with all the events of that iteration in order, so a server can move them to its
own thread in one hop (asyncio: `loop.call_soon_threadsafe`). While the loop runs it holds the
LLM's busy lock: `generate()` / `stream()` / `chat()` called meanwhile raise a RuntimeError.

The offline path does not go through here: `LLM.generate` is unchanged.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from nanovllm.data_parallel_front import DataParallelFront
from nanovllm.features.speculative.drafting import draft_counts
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams
from nanovllm.serve.preparation import ChatPrompt, Prepared, PreparerSpec, prepare_requests
from nanovllm.wiring import lora_adapters

__all__ = ["Accepted", "ChatPrompt", "Delta", "EngineInfo", "EngineLoop", "EngineRequest", "EngineStats",
           "EngineStopped", "Failed", "Finished", "call_sinks"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- events
@dataclass
class Accepted:
    """The request passed validation and is queued: its prompt tokens (and, if asked, its text
    and its first token's text: the one prompt position without a logprob)."""

    prompt_token_ids: list[int]
    prompt_text: str | None = None
    first_token_text: str | None = None


@dataclass
class Delta:
    """What one step added to sample `index`: text, tokens and (if asked) their logprobs as
    {token id: Logprob} dicts; `finish_reason` / `stop_reason` once it ended. The request's
    first delta carries its prompt logprobs (if asked)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list | None
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_logprobs: list | None = None


@dataclass
class Finished:
    """Every sample has ended (the request's last event)."""

    num_cached_tokens: int


class EngineStopped(RuntimeError):
    """The loop stopped, or was told to end every request (a server shutting down)."""


@dataclass
class Failed:
    """The request was refused (a ValueError / TypeError / NotImplementedError of validation,
    instead of Accepted) or the engine failed while it ran (its last event)."""

    error: BaseException


class EngineRequest:
    """One request to the loop: `prompt` (text, token ids, a vLLM prompt dict or a ChatPrompt)
    and its SamplingParams. `sink(event)` receives, in order: Accepted or Failed; then Deltas;
    then Finished, or Failed if the engine failed. `tokenize_only`: the prompt is only turned
    into token ids (and text, if asked): Accepted, then Finished, nothing generated (`params`
    may be None). `prepared`: the request prepared already (preparation.py; the loop then only
    adds it). `lora_request`: its adapter. Fields other than these belong to the loop."""

    def __init__(self, prompt, params: SamplingParams | None, sink: Callable[[object], None],
                 fill_max_tokens: bool = False, want_prompt_text: bool = False, tokenize_only: bool = False,
                 prepared: Prepared | None = None, lora_request=None):
        self.prompt = prompt
        self.lora_request = lora_request  # a LoRARequest (nanovllm.lora.request), or None: the base model
        self.prepared = prepared
        self.params = params
        self.sink = sink
        # fill_max_tokens: max_tokens becomes what the context and the KV cache leave after the
        # prompt (a chat request without a limit); want_prompt_text: Accepted carries the
        # prompt's text, decoded from token ids if need be (echo).
        self.fill_max_tokens = fill_max_tokens
        self.want_prompt_text = want_prompt_text
        self.tokenize_only = tokenize_only
        self.request_id: int | None = None  # set by an EngineProcess (its key on both sides)
        self.seq = None        # its Sequence (sample 0) once added
        self.done = False      # no more events will come
        self.aborted = False   # the caller aborted it (maybe before it was added)
        self._first_sent = False


@dataclass(frozen=True)
class EngineInfo:
    """What a server needs to know of the engine it drives."""

    generation_defaults: dict  # generation_config.json's sampling defaults
    max_model_len: int
    preparer: PreparerSpec  # what preparing a request off the engine needs


@dataclass(frozen=True)
class EngineStats:
    """The loop's view of the engine after its latest iteration (read from any thread).
    `progress_at`: when that iteration ended (time.monotonic(), one clock for the processes of a
    machine): with requests in the engine, how long ago tells whether it is stuck."""

    num_kv_blocks: int
    free_kv_blocks: int
    running: int
    waiting: int
    requests: int
    steps: int
    progress_at: float
    drafts: tuple[int, int, int] = (0, 0, 0)  # speculative decoding: drafts, drafted and accepted tokens

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting or self.requests)

    def counts(self) -> tuple:
        """Everything but progress_at (what tells whether the stats changed; 50x cheaper than
        dataclasses.astuple, which the loop would pay every iteration)."""
        return self.num_kv_blocks, self.free_kv_blocks, self.running, self.waiting, self.requests, self.steps, \
            self.drafts


def call_sinks(items: list[tuple[EngineRequest, object]]) -> None:
    """Each event to its request's sink (the default dispatch, on the loop thread; a server's,
    on its event loop). Requests aborted meanwhile get nothing: an EngineProcess's events may
    be on their way to this thread when the abort is made."""
    for request, event in items:
        if not request.aborted:
            request.sink(event)


# Why a data-parallel LLM cannot be served (and what to do instead).
SINGLE_ENGINE_ONLY = ("the engine loop (and so the OpenAI server) drives one engine in this process; a data-parallel "
                      "LLM (data_parallel_size > 1 or distributed_executor_backend='ray') has none: run one server "
                      "per replica behind a load balancer")


class EngineLoop:
    """Owns `llm` on a background thread while it runs (see the module docstring).

    `start()` takes the LLM's busy lock (a RuntimeError if it is generating), `submit(requests)`
    and `abort(request)` may be called from any thread, `stop()` aborts what is left, releases
    the lock and joins the thread. `stats` is an EngineStats; `error` the exception that
    stopped the loop, if one did (the engine is then unusable: a dead tensor-parallel worker).
    """

    def __init__(self, llm: LLM, dispatch: Callable[[list], None] = call_sinks,
                 on_stats: Callable[[EngineStats], None] | None = None):
        if isinstance(llm, DataParallelFront):
            raise ValueError(SINGLE_ENGINE_ONLY)
        self.llm = llm
        self.dispatch = dispatch
        self.on_stats = on_stats  # called with the new stats after an iteration that changed them but had no events
        self.info = EngineInfo(dict(llm.generation_defaults), llm.config.max_model_len, PreparerSpec.of(llm))
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[int, EngineRequest] = {}  # seq id of every live sample -> its request
        self._outbox: list[tuple[EngineRequest, object]] = []
        self._thread: threading.Thread | None = None
        self._steps = 0
        self.stats = self._current_stats()

    # ------------------------------------------------------------------ any thread
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def heard_at(self) -> float:
        """When the engine last answered: now, in this process (a frozen process has no one to ask)."""
        return time.monotonic()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("this engine loop was started already")
        if not self.llm._busy.acquire(blocking=False):
            raise RuntimeError("this LLM is already generating: an engine loop needs it to itself")
        self._thread = threading.Thread(target=self._run, name="nanovllm-engine-loop", daemon=True)
        self._thread.start()

    def submit(self, requests: list[EngineRequest]) -> None:
        """Queue requests, validated together: all are added, or all get the same Failed."""
        if not self.running:
            raise RuntimeError("the engine loop is not running" + (f" ({self.error!r})" if self.error else ""))
        self._commands.put(("add", list(requests)))

    def abort(self, request: EngineRequest) -> None:
        """End `request` now, freeing its KV blocks; no further events (idempotent)."""
        self._commands.put(("abort", request))

    def abort_all(self, reason: str = "the server is shutting down") -> None:
        """End every request now: each gets Failed(EngineStopped(reason)); the loop runs on."""
        self._commands.put(("abort_all", reason))

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort every request (each gets Failed), release the LLM and join the thread."""
        if self._thread is None:
            return
        self._commands.put(("stop", None))
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"the engine loop did not stop within {timeout} s")

    # ------------------------------------------------------------------ the loop thread
    def _run(self) -> None:
        try:
            while self._handle_commands(wait=not self.llm.has_unfinished()):
                if self.llm.has_unfinished():
                    self._step()
                self._flush()
        except BaseException as e:  # noqa: BLE001 (a bug or a dead engine: every request must hear of it)
            logger.exception("the engine loop stopped")
            self.error = e
        finally:
            error = EngineStopped("the server is shutting down") if self.error is None else \
                RuntimeError(f"the engine failed: {self.error!r}")
            self._fail_active(error)
            self._refuse_queued(error)
            self._flush()
            self.llm._busy.release()

    def _handle_commands(self, wait: bool) -> bool:
        """Run the queued commands (waiting for one when `wait`); False on stop."""
        try:
            command = self._commands.get(block=wait)
        except queue.Empty:
            return True
        while True:
            kind, arg = command
            if kind == "stop":
                return False
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                self._abort(arg)
            else:
                self._fail_active(EngineStopped(arg))
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, requests: list[EngineRequest]) -> None:
        llm = self.llm
        try:
            prepared = prepare_requests(llm, requests)  # (only those not prepared already)
            adapters = lora_adapters(llm, [r.lora_request for r in requests], len(requests))
        except (ValueError, TypeError, NotImplementedError, FileNotFoundError) as e:
            for r in requests:
                self._emit(r, Failed(e), last=True)
            return
        for i, (r, p) in enumerate(zip(requests, prepared)):
            if r.aborted:
                r.done = True
                continue
            text = p.prompt_text if r.want_prompt_text else None
            if r.tokenize_only:
                self._emit(r, Accepted(p.prompt_token_ids, text))
                self._emit(r, Finished(0), last=True)
                continue
            r.seq = llm.add_request(p.prompt_token_ids, p.params, track_text=True, prompt=p.prompt_text,
                                    adapter=adapters[i] if adapters else 0)
            for sample in r.seq.samples:
                self._active[sample.seq_id] = r
            self._emit(r, Accepted(p.prompt_token_ids, text, p.first_token_text))

    def _abort(self, r: EngineRequest) -> None:
        r.aborted = True
        if r.seq is None or r.done:
            return
        self._drop(r)
        r.done = True

    def _drop(self, r: EngineRequest) -> None:
        """Abort every sample of an added request (freeing its blocks) and forget it."""
        for sample in r.seq.samples:
            self.llm.abort(sample)
            self.llm.forget_text(sample)
            self._active.pop(sample.seq_id, None)

    def _step(self) -> None:
        llm = self.llm
        try:
            outputs, _, _ = llm.step()
        except Exception as e:
            if getattr(llm, "_closed", False):
                raise  # the engine shut itself down (a dead worker): nothing can run any more
            # The requests of the two steps in flight were aborted; the others carry on.
            logger.exception("an engine step failed")
            for r in {id(r): r for r in self._active.values()}.values():
                if any(s.finish_reason == "abort" for s in r.seq.samples):
                    self._drop(r)
                    self._emit(r, Failed(RuntimeError(f"the engine step failed: {e!r}")), last=True)
            return
        self._steps += 1
        for o in outputs:
            r = self._active.get(o.seq.seq_id)
            if r is None:
                continue  # aborted by its caller
            seq = o.seq
            if o.finished:
                llm.forget_text(seq)  # o.text holds the rest of its text
                del self._active[seq.seq_id]
            _, logprobs = llm._logprobs(seq, o.logprobs or (), o.new_token_ids)
            prompt_logprobs = None
            if not r._first_sent:
                r._first_sent = True
                prompt_logprobs = llm._prompt_logprobs(r.seq)
            self._emit(r, Delta(seq.sample_index, o.text, o.new_token_ids, logprobs, o.finish_reason,
                                seq.stop_reason, prompt_logprobs))
            # Finished after the last sample's last delta (several samples may end in one step:
            # their statuses change before their outputs are handed out).
            if o.finished and not any(s.seq_id in self._active for s in r.seq.samples):
                self._emit(r, Finished(r.seq.num_cached_prompt_tokens or 0), last=True)

    def _fail_active(self, error: BaseException) -> None:
        """End every added request with Failed(error), and the step in flight."""
        for r in {id(r): r for r in self._active.values()}.values():
            self._drop(r)
            self._emit(r, Failed(error), last=True)
        try:
            self.llm.cancel_in_flight()
        except Exception:  # noqa: BLE001 (a dead engine)
            logger.exception("could not cancel the step in flight")

    def _refuse_queued(self, error: BaseException) -> None:
        """The loop is ending: requests still queued get Failed(error)."""
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                for r in arg:
                    self._emit(r, Failed(error), last=True)

    def _emit(self, r: EngineRequest, event, last: bool = False) -> None:
        self._outbox.append((r, event))
        if last:
            r.done = True

    def _flush(self) -> None:
        stats = self._current_stats()
        changed = stats.counts() != self.stats.counts()
        self.stats = stats
        try:
            if self._outbox:
                items, self._outbox = self._outbox, []
                self.dispatch(items)
            elif changed and self.on_stats is not None:
                self.on_stats(stats)
        except Exception:  # noqa: BLE001 (the receiving side is gone: nothing to tell it)
            logger.exception("could not hand out the engine's events")

    def _current_stats(self) -> EngineStats:
        bm, sched = self.llm.block_manager, self.llm.scheduler
        c = draft_counts(sched)
        return EngineStats(bm.num_blocks, bm.num_free_blocks, len(sched.running), len(sched.waiting),
                           len({id(r) for r in self._active.values()}), self._steps, time.monotonic(),
                           (0, 0, 0) if c is None else (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens))
