"""Tensor parallelism under torchrun: `distributed_executor_backend="external_launcher"`.

torchrun starts every rank (on one node or many) with RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT in its environment; each rank runs the same script, with the same
prompts and seed, and gets the same outputs (vLLM's convention). There are no pipes and no
rank 0 driving workers: every rank runs its own engine, and so its own scheduler, on the same
inputs, which makes the same decisions on every rank (the scheduler and block manager depend
on nothing but the requests, the seed and the KV block count, which the ranks agree on at start);
only the model step is split, each rank running its shard of the weights in torchrun's
process group (env:// rendezvous; NCCL on GPUs, gloo on CPU).

Sampled tokens agree on every rank: rows with plain temperature (or greedy) sampling are sampled
on every rank from the shards' candidates (launch/shard_sampling.py, RowSampling), which gives every
rank the same tokens; otherwise rank 0 samples from the gathered logits and broadcasts the tokens
on the device (and, when a row asks for logprobs, the logprob entries on the host).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.core.hooks import ForwardStrategy
from nanovllm.core.model_runner import ModelRunner
from nanovllm.core.step_inputs import StepInput
from nanovllm.launch.shard_sampling import RowSampling
from nanovllm.launch.worker import tp_group

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun_environment() -> dict[str, int]:
    """RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE from torchrun's environment (a clear
    error when the script was not started by torchrun)."""
    missing = [k for k in TORCHRUN_VARIABLES if k not in os.environ]
    if missing:
        raise RuntimeError(f"distributed_executor_backend='external_launcher' runs under torchrun, which sets "
                           f"{', '.join(TORCHRUN_VARIABLES)}; missing: {', '.join(missing)}. Start the script with "
                           f"`torchrun --nproc_per_node <T> script.py` (or python -m torch.distributed.run)")
    try:
        env = {k: int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env["LOCAL_WORLD_SIZE"] = int(os.environ.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))
    except ValueError as e:
        raise RuntimeError(f"torchrun's environment is malformed: {e}") from None
    return env


class _SharedLogprobs:
    """A step's PendingTokens whose logprob entries rank 0 computed alone: `logprobs()` (which
    every rank's engine calls once per step, in the same order) broadcasts them from rank 0."""

    def __init__(self, tokens, rank: int):
        self._tokens, self._rank = tokens, rank

    def result(self) -> list[int]:
        return self._tokens.result()

    def logprobs(self):
        box = [self._tokens.logprobs() if self._rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]


class ExternalLauncherRunner:
    """One torchrun rank's ModelRunner as the Executor (core/executor.py) of an engine that runs
    on every rank."""

    def __init__(self, config: Config, forward_strategy: ForwardStrategy | None = None):
        env = torchrun_environment()
        self.rank, world = env["RANK"], env["WORLD_SIZE"]
        if world != config.parallel.tensor_parallel_size:
            raise ValueError(f"torchrun started {world} processes (WORLD_SIZE) but tensor_parallel_size="
                             f"{config.parallel.tensor_parallel_size}; they must be equal")
        if config.device == "cuda":
            if env["LOCAL_RANK"] >= torch.cuda.device_count():
                raise ValueError(f"LOCAL_RANK={env['LOCAL_RANK']} but this node has {torch.cuda.device_count()} "
                                 "visible GPU(s); start at most that many processes per node")
            torch.cuda.set_device(env["LOCAL_RANK"])
        if env["LOCAL_WORLD_SIZE"] != world:
            # The symmetric-memory all-reduces read the peers' memory: one node only.
            config.parallel.custom_all_reduce = False
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            dist.init_process_group("nccl" if config.device == "cuda" else "gloo", init_method="env://",
                                    rank=self.rank, world_size=world, timeout=timedelta(minutes=10))
        elif dist.get_world_size() != world:
            raise RuntimeError(f"torch.distributed is initialised with {dist.get_world_size()} ranks, torchrun "
                               f"reports WORLD_SIZE={world}")
        try:
            self.runner = ModelRunner(config, forward_strategy, tp_group(config))
        except BaseException:
            self._destroy_group()
            raise
        self.num_blocks = self.runner.num_blocks
        self.startup_seconds = self.runner.startup_seconds
        self._closed = False

    def launch(self, batch, eos_token_ids=frozenset()):
        """ModelRunner.launch with every rank taking part; every rank gets the same tokens."""
        if self._closed:
            raise RuntimeError("this LLM has been shut down")
        step = StepInput.from_batch(batch)
        step.sync_prev = False  # every step leaves its tokens on every rank (below)
        rows = batch.rows
        step.sampling = RowSampling.for_every_rank(rows, eos_token_ids, bool(step.prompt_rows), step.sample_offsets)
        out = self.runner.execute(step)
        sampler = self.runner.sampler
        if step.sampling is not None:
            return sampler.publish(len(rows))
        tokens = sampler.sample(out, rows, eos_token_ids, step=step) if self.rank == 0 else None
        sampler.share_previous()  # rank 0's tokens into every rank's device buffer
        if self.rank != 0:
            tokens = sampler.publish(len(rows))
        if step.prompt_rows or any(s.params.logprobs is not None for s in rows):
            return _SharedLogprobs(tokens, self.rank)
        return tokens

    @property
    def sampler(self):
        """This process's TokenSampler, where the fronts register logits extensions."""
        return self.runner.sampler

    def release(self, seq) -> None:
        self.runner.release(seq)

    def score(self, token_ids: list[int]):
        """Teacher-forced logits (see ModelRunner.score): on rank 0; None on the others. Every
        rank must call it."""
        return self.runner.score(token_ids)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.runner.shutdown()
        self._destroy_group()

    def _destroy_group(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
