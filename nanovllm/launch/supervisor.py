"""Worker lifetime: rank 0 spawns, watches and stops the tensor-parallel worker processes.

`WorkerSupervisor` (one per engine) owns the workers, their pipes and the watchdog thread: a
worker that dies (killed, or an exception) is noticed at once, every wait for the workers is
released (device-side waits of the symmetric-memory all-reduces, NCCL collectives through an
abort), and the caller gets a `WorkerDied` naming the worker and its error.

`PROCESS` holds what a process must remember across engines, because torch keeps the matching
state per process: the process group (an NCCL abort can outlive its engine, and while it runs
no new group can be made) and the engines still open at interpreter exit. (The device-side
waits of the all-reduces, which a death must release, are parallel/device_waits.py's.)
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import threading
import time
import weakref
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from nanovllm.parallel.device_waits import abort_device_waits

logger = logging.getLogger(__name__)

# A worker's exit code when it found itself re-running the caller's script at module level
# (spawned processes import the main script; see worker.refuse_unguarded_main).
UNGUARDED_MAIN_EXIT_CODE = 87


class WorkerDied(RuntimeError):
    """A tensor-parallel worker process exited or raised."""


def death_message(rank: int, proc) -> str:
    message = f"tensor-parallel worker {rank} (pid {proc.pid}) died with exit code {proc.exitcode}"
    if proc.exitcode == UNGUARDED_MAIN_EXIT_CODE:
        message += (": it re-ran the calling script's module-level code, which creates an LLM with several "
                    "processes again. Spawned workers import the main script, so put the code that creates "
                    "the LLM under `if __name__ == \"__main__\":`")
    return message


class _ProcessState:
    """Process-wide facts about tensor-parallel engines (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()  # the watchdog and the caller's thread both add threads
        self._lingering: list[threading.Thread] = []
        self.open_engines: weakref.WeakSet = weakref.WeakSet()
        # Engines still open at exit are shut down (workers told to exit, rendezvous file
        # removed) before multiprocessing's own exit handler kills the workers mid-way.
        atexit.register(self._shutdown_open_engines)

    def linger(self, thread: threading.Thread) -> None:
        """A thread that holds torch's process group, or may yet create it (an NCCL abort that
        has not returned, a rendezvous whose peer died)."""
        with self._lock:
            self._lingering[:] = [t for t in self._lingering if t.is_alive()] + [thread]

    def group_still_held(self) -> bool:
        """While an earlier engine's thread holds the process group, no new TP engine can start."""
        with self._lock:
            return any(t.is_alive() for t in self._lingering)

    def _shutdown_open_engines(self) -> None:
        for engine in list(self.open_engines):
            engine.shutdown()


PROCESS = _ProcessState()


def abort_process_group() -> bool:
    """Abort pending collectives so a rank blocked in one returns with an error. False if there
    was no process group to abort.

    `_abort_process_group` is private torch API (present in 2.11 and 2.13); without it, gloo still
    fails fast when a peer's sockets close, while NCCL would wait for its timeout.
    """
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None or not dist.is_initialized():
        return False
    try:
        abort()
    except Exception as e:  # the group may already be gone
        logger.debug("aborting the process group failed: %s", e)
    return True


class WorkerSupervisor:
    """The worker processes of ranks 1..N-1 of one engine: their pipes, a watchdog thread that
    notices a death, and the abort of everything that waits for them."""

    def __init__(self, num_workers: int, target, args_of_rank):
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        self.failure: str | None = None
        self._abort_lock = threading.Lock()
        self._abort_thread: threading.Thread | None = None
        self.group_aborted = False
        for rank in range(1, num_workers + 1):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, args=(*args_of_rank(rank), child), daemon=True,
                               name=f"nanovllm-tp{rank}")
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name="nanovllm-tp-watchdog")
        self._watchdog.start()

    # ------------------------------------------------------------------ messages
    def send_all(self, message) -> None:
        for conn in self.conns:
            conn.send(message)  # BrokenPipeError if a worker died since the last step

    def expect(self, what: str) -> list:
        """Every worker's next message, which must be of kind `what`; their payloads."""
        payloads = []
        for rank, conn in enumerate(self.conns, start=1):
            kind, payload = self._recv(rank, conn)
            if kind != what:
                raise WorkerDied(f"tensor-parallel worker {rank} failed to start:\n{payload}")
            payloads.append(payload)
        return payloads

    def _recv(self, rank, conn):
        while not conn.poll(0.1):
            if self.failure:
                raise WorkerDied(self.failure)
        try:
            return conn.recv()
        except (EOFError, OSError):  # it died; the watchdog may not have said so yet
            raise WorkerDied(self.worker_death(timeout=5) or death_message(rank, self.procs[rank - 1])) from None

    # ------------------------------------------------------------------ deaths
    def _watch(self) -> None:
        """Notice a dead worker, then release every wait for it."""
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs, start=1)}
        while not self._stop.is_set():
            ready = wait(list(sentinels), timeout=0.2)
            if not ready or self._stop.is_set():
                continue
            rank, proc = sentinels[ready[0]]
            proc.join(timeout=1)
            message = death_message(rank, proc)
            try:
                conn = self.conns[rank - 1]
                if conn.poll(0.5):
                    kind, payload = conn.recv()
                    if kind == "error":
                        message += f":\n{payload}"
            except Exception:
                pass
            self.failure = message
            logger.error(message)
            self.abort_waits()
            return

    def worker_death(self, timeout: float) -> str | None:
        """After an error that a dead worker would explain: the watchdog's word on it (waited for
        up to `timeout` s), or a death it has not reported yet."""
        self._watchdog.join(timeout=timeout)  # it returns once it has seen a death
        dead = [(rank, p) for rank, p in enumerate(self.procs, start=1) if not p.is_alive()]
        if dead and not self.failure:  # the watchdog is still reading its last words
            self.failure = death_message(*dead[0])
        return self.failure

    def abort_waits(self, wait_s: float = 0.0) -> bool:
        """Release rank 0 from anything that waits for the workers: the device-side waits of the
        symmetric-memory all-reduces (also while the model runner is built) and NCCL collectives.
        The NCCL abort starts once, in its own thread (again if the first one came before the
        process group existed); True if it finished within `wait_s`."""
        abort_device_waits()
        with self._abort_lock:
            earlier = self._abort_thread
            if earlier is None or (not earlier.is_alive() and not self.group_aborted and dist.is_initialized()):
                def abort():
                    self.group_aborted = abort_process_group()

                self._abort_thread = threading.Thread(target=abort, daemon=True, name="nanovllm-nccl-abort")
                self._abort_thread.start()
                PROCESS.linger(self._abort_thread)
        self._abort_thread.join(timeout=wait_s)
        return not self._abort_thread.is_alive()

    # ------------------------------------------------------------------ stopping
    def stop(self) -> None:
        """Tell every worker to exit; kill the ones that do not (stuck in a collective)."""
        self._stop.set()
        for conn in self.conns:
            try:
                conn.send(("exit", ()))
            except Exception:
                pass
        for proc in self.procs:
            proc.join(timeout=1 if self.failure else 10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
        # The workers are gone (joined or killed): nothing may wait for them on the device.
        abort_device_waits()


def device_drained(timeout_s: float) -> bool:
    """Whether the work queued on this process's current GPU (collectives included: the compute
    stream waits for them) finishes within `timeout_s`; polled, since a kernel waiting for a dead
    peer may never finish. True without CUDA."""
    if not torch.cuda.is_initialized():
        return True
    done = torch.cuda.Event()
    done.record()
    end = time.monotonic() + timeout_s
    while not done.query():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True
