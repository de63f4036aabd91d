"""Tensor parallelism: rank 0 runs in the caller's process, ranks 1..N-1 in spawned workers.

Each step rank 0 sends the step's `StepInput` (plain lists) to every worker over its own pipe
(no size limit, unlike a fixed shared-memory buffer), then all ranks run the model together;
the layers all-reduce / gather through torch.distributed (NCCL on GPUs, gloo on CPU).
The process group rendezvous goes through a fresh temporary file, so no port or shared-memory
name is hard-coded and several engines can live one after another or side by side.

A worker that dies (killed, or an exception) is noticed by a watchdog thread, which aborts the
process group so that rank 0 never hangs inside a collective, and the caller gets a
RuntimeError naming the worker and its error.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import tempfile
import threading
import time
import traceback
import weakref
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.layers.sampler import filters_off
from nanovllm.utils.dist import abort_device_waits

logger = logging.getLogger("nanovllm")


def init_process_group(config: Config, rank: int, init_file: str) -> None:
    if config.device == "cuda":
        torch.cuda.set_device(rank)
    _rendezvous(config, rank, init_file)


def _rendezvous(config: Config, rank: int, init_file: str) -> None:
    dist.init_process_group("nccl" if config.device == "cuda" else "gloo", init_method=f"file://{init_file}",
                            world_size=config.tensor_parallel_size, rank=rank, timeout=timedelta(minutes=10))


def _exit_with_parent(init_file: str) -> None:
    """End this worker when rank 0's process is gone, even if its main thread is stuck waiting
    for the GPU (say, in a fused all-reduce whose peer will never come): exiting frees the GPU.
    The rendezvous file rank 0 would have removed goes too."""
    parent = mp.parent_process()
    if parent is not None:
        parent.join()
        _remove_quietly(init_file)
        os._exit(1)


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:  # already gone (rank 0 or another worker removed it)
        pass


def _worker_main(config: Config, rank: int, init_file: str, conn) -> None:
    from nanovllm.engine.model_runner import ModelRunner

    threading.Thread(target=_exit_with_parent, args=(init_file,), daemon=True, name="nanovllm-tp-parent-watch").start()
    try:
        conn.send(("joining", None))  # rank 0 joins the rendezvous only once every worker is alive
        init_process_group(config, rank, init_file)
        runner = ModelRunner(config)
        conn.send(("ready", runner.num_blocks))
        while True:
            method, args = conn.recv()
            if method == "exit":
                break
            getattr(runner, method)(*args)
    except EOFError:  # rank 0 went away: nothing left to serve, and nobody else removes the file
        _remove_quietly(init_file)
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class WorkerDied(RuntimeError):
    """A tensor-parallel worker process exited or raised."""


def _death_message(rank: int, proc) -> str:
    return f"tensor-parallel worker {rank} (pid {proc.pid}) died with exit code {proc.exitcode}"


# After a worker died, how long shutdown waits for rank 0's GPU to drain. Seen on 2xH200 (NCCL
# 2.28.9, torch 2.11) with a SIGKILLed worker: the NCCL abort releases the kernels that wait for
# the dead peer within moments, but the abort call itself only returns once this process exits
# (and torch then ends the process with SIGABRT). So it runs in a thread of its own, rank 0
# waits for its device, not for the abort, and the process group is not destroyed.
NCCL_ABORT_WAIT_S = 10.0
# Threads of earlier engines that still hold torch's process group or may yet create it (an NCCL
# abort that has not returned, a rendezvous whose peer died): while one runs, no new
# tensor-parallel engine can start in this process (process-wide, like that group).
_lingering: list[threading.Thread] = []
_lingering_lock = threading.Lock()  # the watchdog and the caller's thread both add to it


def _lingers(thread: threading.Thread) -> None:
    with _lingering_lock:
        _lingering[:] = [t for t in _lingering if t.is_alive()] + [thread]


def _abort_process_group() -> bool:
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


# Engines not shut down yet: at interpreter exit they are (workers told to exit, rendezvous file
# removed) before multiprocessing's own exit handler kills the workers mid-way.
_OPEN_RUNNERS: "weakref.WeakSet[TensorParallelRunner]" = weakref.WeakSet()


@atexit.register
def _shutdown_open_runners() -> None:
    for runner in list(_OPEN_RUNNERS):
        runner.shutdown()


class TensorParallelRunner:
    """Rank 0's ModelRunner plus the workers of ranks 1..N-1; same interface as ModelRunner."""

    def __init__(self, config: Config):
        from nanovllm.engine.model_runner import ModelRunner

        if any(t.is_alive() for t in _lingering):
            raise RuntimeError("an earlier tensor-parallel engine of this process lost a worker and its "
                               "process group has not been released yet; restart the process to use "
                               "tensor parallelism again")
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process (an earlier "
                               "tensor-parallel LLM not shut down? call its shutdown() or use `with LLM(...)`); "
                               "tensor_parallel_size > 1 needs to own the process group")
        self.config = config
        fd, self.init_file = tempfile.mkstemp(prefix="nanovllm-tp-")
        os.close(fd)
        os.unlink(self.init_file)  # the FileStore creates it; a stale one would confuse it
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        self._closed = False
        self._failure: str | None = None
        # Sample on every rank when the batch allows it (see launch); False: always on rank 0
        # (bench.py --gather-logits measures that path).
        self.sample_on_every_rank = True
        self._tokens_on_every_rank = False  # the last step's sampled tokens are on every rank
        self._abort_lock = threading.Lock()
        self._abort_thread: threading.Thread | None = None
        self._group_aborted = False
        for rank in range(1, config.tensor_parallel_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(config, rank, self.init_file, child), daemon=True,
                               name=f"nanovllm-tp{rank}")
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        _OPEN_RUNNERS.add(self)
        self._stop_watchdog = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name="nanovllm-tp-watchdog")
        self._watchdog.start()
        try:
            # A worker that dies before it joins would leave rank 0 waiting in the rendezvous (not
            # abortable) until its timeout: wait for every worker's word first, watchdog in view.
            self._expect("joining")
            self._join_rendezvous()
            self.runner = ModelRunner(config)
            self._expect("ready")
        except BaseException as e:
            self.shutdown()
            if self._failure:
                raise WorkerDied(self._failure) from None
            raise e
        self.num_blocks = self.runner.num_blocks
        self.startup_seconds = self.runner.startup_seconds

    def _join_rendezvous(self) -> None:
        """Rank 0's side of the process group's rendezvous, waited for in a thread: a worker that
        dies in its own init, after it said it joins, would leave the call waiting for its
        10-minute timeout, and nothing aborts a rendezvous. Raises once the watchdog sees a death."""
        if self.config.device == "cuda":
            torch.cuda.set_device(0)
        errors = []

        def join():
            try:
                _rendezvous(self.config, 0, self.init_file)
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=join, daemon=True, name="nanovllm-tp-rendezvous")
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            if self._failure and thread.is_alive():
                _lingers(thread)
                raise WorkerDied(self._failure)
        # A worker that died after it published its address makes gloo's rendezvous fail at once,
        # maybe before the watchdog has said so; and one may die just as the rendezvous ends.
        if (errors and self._worker_death(timeout=5)) or self._failure:
            raise WorkerDied(self._failure)
        if errors:
            raise errors[0]

    def _worker_death(self, timeout: float) -> str | None:
        """After an error that a dead worker would explain: the watchdog's word on it (waited for
        up to `timeout` s), or a death it has not reported yet."""
        self._watchdog.join(timeout=timeout)  # it returns once it has seen a death
        dead = [(rank, p) for rank, p in enumerate(self.procs, start=1) if not p.is_alive()]
        if dead and not self._failure:  # the watchdog is still reading its last words
            self._failure = _death_message(*dead[0])
        return self._failure

    def _expect(self, what: str) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            kind, payload = self._recv(rank, conn)
            if kind != what:
                raise WorkerDied(f"tensor-parallel worker {rank} failed to start:\n{payload}")

    def _recv(self, rank, conn):
        while not conn.poll(0.1):
            if self._failure:
                raise WorkerDied(self._failure)
        try:
            return conn.recv()
        except (EOFError, OSError):  # it died; the watchdog may not have said so yet
            raise WorkerDied(self._worker_death(timeout=5) or _death_message(rank, self.procs[rank - 1])) from None

    def _watch(self) -> None:
        """Notice a dead worker and abort the process group so that rank 0 cannot hang."""
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs, start=1)}
        while not self._stop_watchdog.is_set():
            ready = wait(list(sentinels), timeout=0.2)
            if not ready or self._stop_watchdog.is_set():
                continue
            rank, proc = sentinels[ready[0]]
            proc.join(timeout=1)
            message = _death_message(rank, proc)
            conn = self.conns[rank - 1]
            try:
                if conn.poll(0.5):
                    kind, payload = conn.recv()
                    if kind == "error":
                        message += f":\n{payload}"
            except Exception:
                pass
            self._failure = message
            logger.error(message)
            self._abort_waits()
            return

    def _abort_waits(self, wait_s: float = 0.0) -> bool:
        """Release rank 0 from anything that waits for the workers: the device-side waits of the
        fused and copy-engine all-reduces (also while the model runner is built) and NCCL collectives. The
        NCCL abort starts once, in its own thread (again if the first one came before the process
        group existed); True if it finished within `wait_s`."""
        abort_device_waits()
        with self._abort_lock:
            earlier = self._abort_thread
            if earlier is None or (not earlier.is_alive() and not self._group_aborted and dist.is_initialized()):
                def abort():
                    self._group_aborted = _abort_process_group()

                self._abort_thread = threading.Thread(target=abort, daemon=True, name="nanovllm-nccl-abort")
                self._abort_thread.start()
                _lingers(self._abort_thread)
        self._abort_thread.join(timeout=wait_s)
        return not self._abort_thread.is_alive()

    def _device_drained(self, timeout_s: float) -> bool:
        """Whether the work queued on rank 0's device (collectives included: the compute stream
        waits for them) finishes within `timeout_s`; polled, since a kernel waiting for a dead
        peer may never finish."""
        if self.config.device != "cuda" or not torch.cuda.is_initialized():
            return True
        done = torch.cuda.Event()
        done.record()
        end = time.monotonic() + timeout_s
        while not done.query():
            if time.monotonic() > end:
                return False
            time.sleep(0.005)
        return True

    def _check(self) -> None:
        if self._failure:
            raise WorkerDied(self._failure)
        if self._closed:
            raise RuntimeError("this LLM has been shut down")

    def launch(self, batch, eos_token_ids=frozenset()):
        """ModelRunner.launch across all ranks. Rows with plain temperature (or greedy)
        sampling are sampled on every rank from per-shard candidates; else rank 0 gathers the
        logits and samples alone."""
        from nanovllm.engine.model_runner import RowSampling, StepInput, suppressed_tokens

        step = StepInput.from_batch(batch)
        step.sync_prev = not self._tokens_on_every_rank
        if self.sample_on_every_rank and all(filters_off(s.params) and not suppressed_tokens(s, eos_token_ids)
                                             for s in batch.seqs):
            step.sampling = RowSampling.from_seqs(batch.seqs)
        self._tokens_on_every_rank = step.sampling is not None
        out = self._all_ranks("execute", step)
        if step.sampling is not None:
            return self.runner.publish_tokens(len(batch.seqs), self._raise_if_failed)
        return self.runner.sample(out, batch.seqs, eos_token_ids, self._raise_if_failed)

    def _raise_if_failed(self) -> None:
        """WorkerDied (after shutting down) once a worker died: called while rank 0 waits for
        a step's tokens, which a dead peer may never complete, or complete with garbage."""
        if self._failure:
            self.shutdown()
            raise WorkerDied(self._failure)

    def score(self, token_ids: list[int]):
        """Teacher-forced logits of one sequence across all ranks (see ModelRunner.score)."""
        self.runner.check_score_input(token_ids)
        return self._all_ranks("score", token_ids)

    def _all_ranks(self, method: str, arg):
        """Run `method(arg)` on every rank; rank 0's result."""
        self._check()
        try:
            for conn in self.conns:
                conn.send((method, (arg,)))  # BrokenPipeError if a worker died since the last step
            result = getattr(self.runner, method)(arg)
        except BaseException as e:
            # A failing send or collective is almost always a dead peer: wait briefly for the
            # watchdog. Not after Ctrl-C, which is the user's, and should end the call at once.
            if self._worker_death(timeout=0 if isinstance(e, KeyboardInterrupt) else 5):
                self.shutdown()
                raise WorkerDied(self._failure) from e
            # Rank 0 alone failed (out of memory, Ctrl-C...): the workers are still inside this
            # step's collectives, so the group can never line up again. Close it cleanly.
            self._failure = f"rank 0 failed during a step ({type(e).__name__}: {e}); the tensor-parallel group was shut down"
            self.shutdown()
            raise
        self._check()
        return result

    def shutdown(self) -> None:
        """Stop the workers (killing any stuck in a collective) and release the process group."""
        if self._closed:
            return
        self._closed = True
        _OPEN_RUNNERS.discard(self)
        self._stop_watchdog.set()
        abort_finished = drained = True
        if self._failure:  # nobody will complete the pending collectives
            abort_finished = self._abort_waits()
            drained = self._device_drained(NCCL_ABORT_WAIT_S)
            if drained:  # gloo's abort returns at once; NCCL's (see above) may not
                abort_finished = self._abort_waits(wait_s=2.0)
            else:
                logger.warning("rank 0's GPU is still waiting for the dead worker %.0f s after the abort; "
                               "its memory is freed when this process exits", NCCL_ABORT_WAIT_S)
        for conn in self.conns:
            try:
                conn.send(("exit", ()))
            except Exception:
                pass
        for proc in self.procs:
            proc.join(timeout=1 if self._failure else 10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
        # The workers are gone (joined or killed): nothing may wait for them on the device, or
        # the runner's final synchronize would.
        abort_device_waits()
        if getattr(self, "runner", None) is not None:
            self.runner.shutdown(synchronize=drained)
        if abort_finished and dist.is_initialized():  # else destroying it would wait for the abort
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        _remove_quietly(self.init_file)
