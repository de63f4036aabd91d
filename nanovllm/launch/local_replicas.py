"""Data-parallel replicas as local processes: the `ReplicaLauncher` of one node, no extra package.

Replica r is a spawned process (replica.py) that owns GPUs r*T .. r*T+T-1 of the ones this
process sees: its CUDA_VISIBLE_DEVICES is set before it starts, so CUDA in the replica (and in
its tensor-parallel workers, which inherit it) never sees another replica's GPUs. Requests and
outputs travel over one pipe per replica (plain lists and dataclasses, pickled; no size limit).

One reader thread waits on every pipe and every process at once, turns what arrives into
ReplicaEvents, and notices a death at once (the process's sentinel), with the replica's last
words (a traceback) when it left any. Replicas are not daemonic (a daemonic process may not
start the tensor-parallel workers a replica needs), so shutdown joins or kills them itself;
an engine left open is shut down at interpreter exit (supervisor.PROCESS), and a replica whose
front process is killed exits by itself (replica._exit_with_parent).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from multiprocessing.connection import wait

from nanovllm.launch.replica import ReplicaEvent, ReplicaFailed, ReplicaLauncher, replica_process_main
from nanovllm.launch.supervisor import UNGUARDED_MAIN_EXIT_CODE


# How long shutdown waits for a replica to stop its engine (and tensor-parallel workers) before
# killing it, and how long the reader waits for a dying replica's last message.
STOP_TIMEOUT_S = 10.0
LAST_WORDS_S = 0.5


def replica_devices(num_replicas: int, tp: int) -> list[list[str]]:
    """The GPUs (as CUDA_VISIBLE_DEVICES entries) of each replica: consecutive groups of `tp` of
    the GPUs this process sees (its own CUDA_VISIBLE_DEVICES, if set, else all of them)."""
    import torch

    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [d.strip() for d in env.split(",") if d.strip()] if env is not None \
        else [str(i) for i in range(torch.cuda.device_count())]
    if num_replicas * tp > len(visible):
        raise ValueError(f"data_parallel_size={num_replicas} x tensor_parallel_size={tp} needs {num_replicas * tp} "
                         f"GPUs; {len(visible)} are visible")
    return [visible[r * tp:(r + 1) * tp] for r in range(num_replicas)]


@contextlib.contextmanager
def _environment(changes: dict[str, str]):
    """os.environ with `changes` for the block (a spawned process starts with the environment
    of the moment it is started)."""
    old = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def exit_description(code: int | None) -> str:
    """How a replica process with this exit code ended, in words (signals by name)."""
    if code is None:
        return "is gone"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if code == UNGUARDED_MAIN_EXIT_CODE:
        return ("re-ran the calling script's module-level code, which creates an LLM with several processes "
                "again: put the code that creates the LLM under `if __name__ == \"__main__\":`")
    return f"exited with code {code}"


class LocalReplicaLauncher(ReplicaLauncher):
    """Replicas as spawned processes of this node (see the module docstring)."""

    def __init__(self, engine_class, config, engine_kwargs: dict):
        n, tp = config.parallel.data_parallel_size, config.parallel.tensor_parallel_size
        self.num_replicas = n
        self.devices = replica_devices(n, tp) if config.device == "cuda" else None
        env = {}
        if config.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # Each replica would otherwise start a thread per core: n x T processes fighting over them.
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (n * tp)))
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        self.dead: dict[int, str] = {}  # replica -> how it died
        self._events: queue.Queue[ReplicaEvent] = queue.Queue()
        self._stop = threading.Event()
        self._closed = False
        try:
            for r in range(n):
                parent, child = ctx.Pipe()
                if self.devices is not None:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(self.devices[r])
                with _environment(env):
                    proc = ctx.Process(target=replica_process_main, name=f"nanovllm-dp{r}",
                                       args=(r, engine_class, config.model, engine_kwargs, child))
                    proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
        except BaseException:
            self.shutdown()
            raise
        self._reader = threading.Thread(target=self._read, daemon=True, name="nanovllm-dp-reader")
        self._reader.start()

    # ------------------------------------------------------------------ events
    def _read(self) -> None:
        """Turn the replicas' messages and deaths into events until shutdown."""
        live = set(range(self.num_replicas))
        while live and not self._stop.is_set():
            by_conn = {self.conns[r]: r for r in live}
            by_sentinel = {self.procs[r].sentinel: r for r in live}
            for ready in wait(list(by_conn) + list(by_sentinel), timeout=0.2):
                if self._stop.is_set():
                    return
                r = by_conn.get(ready, by_sentinel.get(ready))
                if r not in live:
                    continue
                if ready in by_conn:
                    try:
                        kind, job, payload = self.conns[r].recv()
                    except (EOFError, OSError):
                        live.discard(r)
                        self._report_death(r, None)
                        continue
                    self._events.put(ReplicaEvent(kind, r, job, payload))
                else:
                    live.discard(r)
                    self._report_death(r, self._last_words(r))

    def _last_words(self, r: int) -> str | None:
        """The traceback a dying replica sent, if it is still in the pipe."""
        conn, words = self.conns[r], None
        try:
            while conn.poll(LAST_WORDS_S):
                kind, job, payload = conn.recv()
                if kind == "error":
                    words = payload
                else:
                    self._events.put(ReplicaEvent(kind, r, job, payload))
        except (EOFError, OSError):
            pass
        return words

    def _report_death(self, r: int, words: str | None) -> None:
        if self._stop.is_set():
            return
        proc = self.procs[r]
        proc.join(timeout=1)
        message = f"the process {exit_description(proc.exitcode)}"
        if words:
            message += f":\n{words}"
        self._mark_dead(r, None, message)

    def next_event(self, timeout: float) -> ReplicaEvent | None:
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def describe(self, replica: int) -> str:
        where = f"pid {self.procs[replica].pid}" if replica < len(self.procs) else "not started"
        if self.devices is not None:
            where += f", GPUs {','.join(self.devices[replica])}"
        return where

    # ------------------------------------------------------------------ calls
    def submit(self, replica: int, job: int, method: str, args: tuple) -> None:
        self._refuse_if_dead(replica)
        try:
            self.conns[replica].send((method, job, args))
        except OSError:  # it died since the last call; the reader has its word on it
            self.procs[replica].join(timeout=5)
            raise ReplicaFailed(f"data-parallel replica {replica} ({self.describe(replica)}) "
                                f"{exit_description(self.procs[replica].exitcode)}", replica) from None

    def shutdown(self, abandon: bool = False) -> None:
        """Ask every replica to stop its engine, then kill the ones still there after
        STOP_TIMEOUT_S (all together; 1 s when abandoning a call or after a death)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.join(timeout=1)  # it wakes every 0.2 s; then nobody reads the pipes closed below
        for conn in self.conns:
            try:
                conn.send(("exit", None, ()))
            except Exception:
                pass
        end = time.monotonic() + (1.0 if abandon or self.dead else STOP_TIMEOUT_S)
        for proc in self.procs:
            proc.join(timeout=max(0.0, end - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
