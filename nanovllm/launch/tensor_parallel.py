"""Tensor parallelism from the caller's side: rank 0 runs in the caller's process, ranks 1..N-1
in spawned workers (worker.py) that a WorkerSupervisor watches.

Each step rank 0 sends the step's `StepInput` (plain lists) to every worker over its own pipe
(no size limit, unlike a fixed shared-memory buffer), then all ranks run the model together;
the layers all-reduce / gather through torch.distributed (NCCL on GPUs, gloo on CPU).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.core.hooks import ForwardStrategy
from nanovllm.core.model_runner import ModelRunner
from nanovllm.core.step_inputs import StepInput
from nanovllm.launch import worker
from nanovllm.launch.shard_sampling import RowSampling
from nanovllm.launch.supervisor import PROCESS, WorkerDied, WorkerSupervisor, device_drained

logger = logging.getLogger(__name__)

# After a worker died, how long shutdown waits for rank 0's GPU to drain. Seen on 2xH200 (NCCL
# 2.28.9, torch 2.11) with a SIGKILLed worker: the NCCL abort releases the kernels that wait for
# the dead peer within moments, but the abort call itself only returns once this process exits
# (and torch then ends the process with SIGABRT). So it runs in a thread of its own, rank 0
# waits for its device, not for the abort, and the process group is not destroyed.
NCCL_ABORT_WAIT_S = 10.0


class TensorParallelRunner:
    """Rank 0's ModelRunner plus the workers of ranks 1..N-1: an Executor (core/executor.py)."""

    def __init__(self, config: Config, forward_strategy: ForwardStrategy | None = None):
        worker.refuse_unguarded_main()  # spawned workers import the main script
        if PROCESS.group_still_held():
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
        self._closed = False
        # Sample on every rank when the batch allows it (see launch); False: always on rank 0
        # (bench.py --gather-logits measures that path).
        self.sample_on_every_rank = True
        self._tokens_on_every_rank = False  # the last step's sampled tokens are on every rank
        self.runner = None
        self.workers = WorkerSupervisor(config.parallel.tensor_parallel_size - 1, worker.worker_main,
                                        lambda rank: (config, rank, self.init_file, forward_strategy))
        PROCESS.open_engines.add(self)
        try:
            # A worker that dies before it joins would leave rank 0 waiting in the rendezvous (not
            # abortable) until its timeout: wait for every worker's word first, watchdog in view.
            self.workers.expect("joining")
            self._join_rendezvous()
            self.runner = ModelRunner(config, forward_strategy, worker.tp_group(config))
            self.workers.expect("ready")
        except BaseException as e:
            self.shutdown()
            if self.workers.failure:
                raise WorkerDied(self.workers.failure) from None
            raise e
        self.num_blocks = self.runner.num_blocks
        self.startup_seconds = self.runner.startup_seconds

    @property
    def procs(self):
        return self.workers.procs

    @property
    def conns(self):
        return self.workers.conns

    def _join_rendezvous(self) -> None:
        """Rank 0's side of the process group's rendezvous, waited for in a thread: a worker that
        dies in its own init, after it said it joins, would leave the call waiting for its
        10-minute timeout, and nothing aborts a rendezvous. Raises once the watchdog sees a death."""
        if self.config.device == "cuda":
            torch.cuda.set_device(0)
        errors = []

        def join():
            try:
                worker.rendezvous(self.config, 0, self.init_file)
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=join, daemon=True, name="nanovllm-tp-rendezvous")
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            if self.workers.failure and thread.is_alive():
                PROCESS.linger(thread)
                raise WorkerDied(self.workers.failure)
        # A worker that died after it published its address makes gloo's rendezvous fail at once,
        # maybe before the watchdog has said so; and one may die just as the rendezvous ends.
        if (errors and self.workers.worker_death(timeout=5)) or self.workers.failure:
            raise WorkerDied(self.workers.failure)
        if errors:
            raise errors[0]

    def _check(self) -> None:
        if self.workers.failure:
            raise WorkerDied(self.workers.failure)
        if self._closed:
            raise RuntimeError("this LLM has been shut down")

    def launch(self, batch, eos_token_ids=frozenset()):
        """ModelRunner.launch across all ranks. Who samples is decided by
        RowSampling.for_every_rank (launch/shard_sampling.py, the one place): rows with plain
        temperature (or greedy) sampling are sampled on every rank from per-shard candidates;
        else rank 0 gathers the logits and samples alone."""
        step = StepInput.from_batch(batch)
        step.sync_prev = not self._tokens_on_every_rank
        rows = batch.rows
        if self.sample_on_every_rank:
            step.sampling = RowSampling.for_every_rank(rows, eos_token_ids, bool(step.prompt_rows), step.sample_offsets)
        self._tokens_on_every_rank = step.sampling is not None
        out = self._all_ranks("execute", step)
        if step.sampling is not None:
            return self.runner.sampler.publish(len(rows), self._raise_if_failed)
        return self.runner.sampler.sample(out, rows, eos_token_ids, self._raise_if_failed, step=step)

    @property
    def sampler(self):
        """This process's TokenSampler, where the fronts register logits extensions."""
        return self.runner.sampler

    def release(self, seq) -> None:
        """A request ended: drop its sampling state (only rank 0 samples with any)."""
        self.runner.release(seq)

    def _raise_if_failed(self) -> None:
        """WorkerDied (after shutting down) once a worker died: called while rank 0 waits for
        a step's tokens, which a dead peer may never complete, or complete with garbage."""
        if self.workers.failure:
            self.shutdown()
            raise WorkerDied(self.workers.failure)

    def score(self, token_ids: list[int]):
        """Teacher-forced logits of one sequence across all ranks (see ModelRunner.score)."""
        self.runner.check_score_input(token_ids)
        return self._all_ranks("score", token_ids)

    def _all_ranks(self, method: str, arg):
        """Run `method(arg)` on every rank; rank 0's result."""
        self._check()
        try:
            self.workers.send_all((method, (arg,)))
            result = getattr(self.runner, method)(arg)
        except BaseException as e:
            # A failing send or collective is almost always a dead peer: wait briefly for the
            # watchdog. Not after Ctrl-C, which is the user's, and should end the call at once.
            if self.workers.worker_death(timeout=0 if isinstance(e, KeyboardInterrupt) else 5):
                self.shutdown()
                raise WorkerDied(self.workers.failure) from e
            # Rank 0 alone failed (out of memory, ...): the workers are still inside this step's
            # collectives, so the group can never line up again. Close it cleanly. (A Ctrl-C
            # delivered as a signal does not get here: the engine holds it until the step ends.)
            self.workers.failure = (f"rank 0 failed during a step ({type(e).__name__}: {e}); "
                                    f"the tensor-parallel group was shut down")
            self.shutdown()
            raise
        self._check()
        return result

    def shutdown(self) -> None:
        """Stop the workers (killing any stuck in a collective) and release the process group."""
        if self._closed:
            return
        self._closed = True
        PROCESS.open_engines.discard(self)
        abort_finished = drained = True
        if self.workers.failure:  # nobody will complete the pending collectives
            abort_finished = self.workers.abort_waits()
            drained = self.config.device != "cuda" or device_drained(NCCL_ABORT_WAIT_S)
            if drained:  # gloo's abort returns at once; NCCL's (see above) may not
                abort_finished = self.workers.abort_waits(wait_s=2.0)
            else:
                logger.warning("rank 0's GPU is still waiting for the dead worker %.0f s after the abort; "
                               "its memory is freed when this process exits", NCCL_ABORT_WAIT_S)
        self.workers.stop()
        if self.runner is not None:
            self.runner.shutdown(synchronize=drained)
        if abort_finished and dist.is_initialized():  # else destroying it would wait for the abort
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        worker.remove_quietly(self.init_file)
