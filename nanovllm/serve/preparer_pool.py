"""The server's preparer workers: processes that prepare requests (preparation.py), so that the
engine's process only steps and the server's event loop only serves HTTP.

Tokenizing a long prompt, rendering a chat template, checking a large logit_bias: each holds
the GIL of the process it runs in. In a worker of its own it delays neither the engine's steps
nor the other streams' chunks. A job that runs past the time limit (a chat template that loops)
is refused, and its worker is killed and replaced: nothing of it runs on.

    parent -> worker   PreparerSpec once; then one job per message: [Ask, ...]
    worker -> parent   ("ready",) or ("failed", exception) once; then per job
                       ("ok", [Prepared, ...]) or ("error", exception)
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple

from nanovllm.serve.errors import picklable
from nanovllm.serve.preparation import PreparerSpec, RequestPreparer, prepare_requests

logger = logging.getLogger(__name__)


class PrepareTimeout(Exception):
    """A request's preparation ran past the time limit (its worker was killed)."""


class Ask(NamedTuple):
    """What a worker needs of one EngineRequest."""

    prompt: object
    params: object
    fill_max_tokens: bool
    want_prompt_text: bool
    tokenize_only: bool

    @classmethod
    def of(cls, r) -> "Ask":
        return cls(r.prompt, r.params, r.fill_max_tokens, r.want_prompt_text, r.tokenize_only)


class _Worker:
    """One worker process and the parent's end of its pipe; one job at a time."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child,), name="nanovllm-preparer", daemon=True)
        self.proc.start()
        child.close()

    def ready(self, spec: PreparerSpec) -> None:
        """Hand it the spec and wait until it has loaded the tokenizer (its error if it could not)."""
        self.conn.send(spec)
        try:
            kind, *rest = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(10)
            raise RuntimeError(f"a preparer worker exited while starting (exit code {self.proc.exitcode})") from None
        if kind == "failed":
            raise rest[0]

    def call(self, asks: list[Ask], timeout: float):
        """("ok", prepared) or ("error", exception); PrepareTimeout past `timeout` seconds."""
        self.conn.send(asks)
        if not self.conn.poll(timeout):
            raise PrepareTimeout(timeout)
        return self.conn.recv()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)
        self.conn.close()


class PreparerPool:
    """`size` preparer workers. `spawn()` starts their processes (they import while the engine
    loads), `start(spec)` waits until each has its tokenizer; `await prepare(requests)` returns
    a Prepared per EngineRequest or raises preparation's error, PrepareTimeout after `timeout`
    seconds, or a RuntimeError when a worker died. `on_empty(error)` is called (on a thread of
    the pool) when no worker is left and none could be started."""

    def __init__(self, size: int, timeout: float, on_empty: Callable[[BaseException], None] | None = None):
        if size < 1:
            raise ValueError(f"a preparer pool needs at least one worker, got {size}")
        self.size, self.timeout, self.on_empty = size, timeout, on_empty
        self.spec: PreparerSpec | None = None
        self._spawned: list[_Worker] = []
        self._idle: asyncio.Queue = asyncio.Queue()
        self._threads = ThreadPoolExecutor(size, thread_name_prefix="nanovllm-prepare")
        self._alive = 0
        self._stopped = False
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def spawn(self) -> None:
        self._spawned = [_Worker() for _ in range(self.size)]

    def start(self, spec: PreparerSpec) -> None:
        if not self._spawned:
            self.spawn()
        self.spec = spec
        try:
            for w in self._spawned:
                w.ready(spec)
        except BaseException:
            self.stop()
            raise
        for w in self._spawned:
            self._idle.put_nowait(w)
        self._alive = len(self._spawned)

    async def prepare(self, requests: list) -> list:
        self._loop = asyncio.get_running_loop()
        worker = await self._idle.get()
        kind, result = await self._loop.run_in_executor(self._threads, self._call, worker,
                                                        [Ask.of(r) for r in requests])
        if kind == "error":
            raise result
        return result

    def _call(self, worker: _Worker, asks: list[Ask]):
        """On a pool thread: the job, then the worker back to the idle queue (here, so that a
        cancelled caller never leaves it out); a worker that timed out or died is replaced."""
        try:
            answer = worker.call(asks, self.timeout)
        except PrepareTimeout:
            self._replace(worker, f"its job ran past {self.timeout} s")
            raise
        except (EOFError, OSError):
            self._replace(worker, f"it died (exit code {worker.proc.exitcode})")
            raise RuntimeError("the request's preparer worker died") from None
        self._loop.call_soon_threadsafe(self._idle.put_nowait, worker)
        return answer

    def _replace(self, worker: _Worker, why: str) -> None:
        worker.kill()
        if self._stopped:
            return
        logger.warning("preparer worker %s killed: %s", worker.proc.pid, why)
        threading.Thread(target=self._start_replacement, name="nanovllm-preparer-start", daemon=True).start()

    def _start_replacement(self) -> None:
        try:
            fresh = _Worker()
            self._spawned.append(fresh)
            fresh.ready(self.spec)
        except Exception:  # noqa: BLE001 (one fewer worker; none left ends the server)
            logger.exception("could not start a preparer worker")
            with self._lock:
                self._alive -= 1
                empty = self._alive == 0
            if empty and self.on_empty is not None:
                self.on_empty(RuntimeError("no preparer worker is left, and none could be started"))
            return
        self._loop.call_soon_threadsafe(self._idle.put_nowait, fresh)

    def stop(self) -> None:
        self._stopped = True
        for w in self._spawned:
            if w.proc.is_alive():
                w.kill()
        self._threads.shutdown(wait=False, cancel_futures=True)

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._spawned if w.proc.is_alive()]


def _worker_main(conn) -> None:
    """A worker: build the RequestPreparer from the spec, then answer jobs until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when its workers stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        front = RequestPreparer(conn.recv())
    except EOFError:
        return
    except BaseException as e:  # noqa: BLE001 (the server raises it)
        conn.send(("failed", picklable(e)))
        return
    conn.send(("ready",))
    while True:
        try:
            asks = conn.recv()
        except EOFError:
            return  # the server is gone
        try:
            answer = ("ok", prepare_requests(front, asks))
        except Exception as e:  # noqa: BLE001 (preparation's errors are the request's)
            answer = ("error", picklable(e))
        conn.send(answer)

