"""What one data-parallel replica runs, wherever it runs (a local process or a Ray actor), and
the interface between the front (data_parallel.py) and the launchers that run replicas.

A `Replica` is an ordinary engine (`engine_class`, the LLM class, of T GPUs: tensor-parallel
workers of its own when T > 1) fed requests the front has already validated. `serve_pipe` is
the loop of a local replica process: one `(method, job, args)` message at a time from the
front's pipe, answered with "progress" / "result" / "error" messages tagged with the job.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import threading
import time
import traceback
from dataclasses import dataclass


class ReplicaFailed(RuntimeError):
    """A data-parallel replica died or raised during a call. `replica`: its index;
    `unfinished`: indices (into the call's prompts) of the prompts without an output;
    `outputs`: the call's outputs, None where unfinished."""

    def __init__(self, message: str, replica: int | None = None, unfinished: list[int] | None = None,
                 outputs: list | None = None):
        super().__init__(message)
        self.replica = replica
        self.unfinished = unfinished or []
        self.outputs = outputs


@dataclass
class ReplicaEvent:
    """What a launcher reports: kind "ready" (payload: the replica's info dict), "progress"
    (completions finished), "result" (the job's return value), "error" (a traceback: the job
    raised, the replica lives) or "died" (a message: the replica is gone)."""

    kind: str
    replica: int
    job: int | None = None
    payload: object = None


class ReplicaLauncher:
    """Where the replicas of a data-parallel LLM run; one interface, local processes or Ray.

    The constructor starts every replica (each builds `engine_class(model, **engine_kwargs)`)
    without waiting for them; then the front reads `next_event` until each said "ready" (or
    died). `submit(r, job, method, args)` runs `method(*args)` of replica r's `Replica`
    (replica.py) and reports "progress" / "result" / "error" events tagged with `job`.
    """

    num_replicas: int
    dead: dict[int, str]  # replica -> how it died (set by _mark_dead)
    _events: "queue.Queue[ReplicaEvent]"  # what next_event returns, filled by the launcher's threads

    def submit(self, replica: int, job: int, method: str, args: tuple) -> None:
        raise NotImplementedError

    def next_event(self, timeout: float) -> ReplicaEvent | None:
        """The next event of any replica, or None after `timeout` seconds without one."""
        raise NotImplementedError

    def describe(self, replica: int) -> str:
        """How error messages name a replica (its process id, actor id, node...)."""
        raise NotImplementedError

    def shutdown(self, abandon: bool = False) -> None:
        """Stop every replica (killing the ones that do not stop in time); idempotent.
        abandon=True: replicas may be mid-call (a failure, Ctrl-C): give them a moment only."""
        raise NotImplementedError

    # ------------------------------------------------------------------ for the launchers
    def _mark_dead(self, replica: int, job: int | None, message: str) -> None:
        """Replica `replica` died (`message`: how): remembered, logged, and a "died" event."""
        self.dead[replica] = message
        logging.getLogger(type(self).__module__).error("data-parallel replica %d (%s) %s", replica,
                                                       self.describe(replica), message)
        self._events.put(ReplicaEvent("died", replica, job, message))

    def _refuse_if_dead(self, replica: int) -> None:
        """ReplicaFailed when `replica` died earlier (submit's first check)."""
        if replica in self.dead:
            raise ReplicaFailed(f"data-parallel replica {replica} ({self.describe(replica)}) died earlier: "
                                f"{self.dead[replica]}", replica)


class Replica:
    """One replica's engine, and the calls the data-parallel front makes on it."""

    def __init__(self, index: int, engine_class, model: str, engine_kwargs: dict):
        self.index = index
        self.llm = engine_class(model, **engine_kwargs)

    def info(self) -> dict:
        """What the front learns once the replica is ready (and error messages show)."""
        runner = self.llm.model_runner
        return {"pid": os.getpid(), "host": socket.gethostname(), "num_blocks": self.llm.block_manager.num_blocks,
                "startup_seconds": runner.startup_seconds, "worker_pids": [p.pid for p in getattr(runner, "procs", ())],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def generate(self, prompts: list[dict], params: list, progress=None) -> dict:
        """The replica's share of a call: {"outputs", "prompt_tokens", "output_tokens", "seconds"}.
        progress(n) is told each time n more completions have finished."""
        t0 = time.perf_counter()
        bar = (lambda **_: _ProgressRelay(progress)) if progress is not None else False
        outputs = self.llm.generate(prompts, params, use_tqdm=bar)
        return {"outputs": outputs, "seconds": time.perf_counter() - t0,
                "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
                "output_tokens": sum(len(c.token_ids) for o in outputs for c in o.outputs)}

    def reset_prefix_cache(self) -> bool:
        return self.llm.reset_prefix_cache()

    def shutdown(self) -> None:
        self.llm.shutdown()


class _ProgressRelay:
    """A stand-in for the replica's tqdm bar that passes the finished counts on to the front."""

    def __init__(self, progress):
        self.progress = progress

    def update(self, n: int = 1) -> None:
        if n:
            self.progress(n)

    def set_postfix(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


def _exit_with_parent() -> None:
    """End this replica when the front's process is gone (killed, say), even while its main
    thread is busy in a step; its tensor-parallel workers follow it the same way."""
    import multiprocessing as mp

    parent = mp.parent_process()
    if parent is not None:
        parent.join()
        os._exit(1)


def replica_process_main(index: int, engine_class, model: str, engine_kwargs: dict, conn) -> None:
    """Entry point of a local replica process (local_replicas.py starts it with its
    CUDA_VISIBLE_DEVICES already set, so CUDA only ever sees the replica's own GPUs)."""
    # Ctrl-C in a terminal reaches the whole process group; the front decides what a replica
    # does about it (this process's tensor-parallel workers inherit the setting).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, daemon=True, name="nanovllm-dp-parent-watch").start()
    try:
        replica = Replica(index, engine_class, model, engine_kwargs)
        conn.send(("ready", None, replica.info()))
    except BaseException:
        _send_quietly(conn, ("error", None, traceback.format_exc()))
        os._exit(1)
    try:
        serve_pipe(replica, conn)
    finally:
        replica.shutdown()


def serve_pipe(replica: Replica, conn) -> None:
    """Run the front's messages until "exit" (or the front's end of the pipe closes)."""
    while True:
        try:
            method, job, args = conn.recv()
        except EOFError:
            return
        if method == "exit":
            return
        try:
            kwargs = {"progress": lambda n: conn.send(("progress", job, n))} if method == "generate" else {}
            result = getattr(replica, method)(*args, **kwargs)
        except Exception:
            conn.send(("error", job, traceback.format_exc()))
            continue
        conn.send(("result", job, result))


def _send_quietly(conn, message) -> None:
    try:
        conn.send(message)
    except Exception:  # the front is gone
        pass
