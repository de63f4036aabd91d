"""The `Executor`: what runs the model for an engine, as the engine sees it.

One engine step is `launch(batch, eos_token_ids)`: queue the batch's forward and sampling on the
device and return at once, with the tokens still on their way (`StepTokens`). Three executors:
the single-process `ModelRunner` (core/model_runner.py), and in launch/ the tensor-parallel
rank 0 that drives worker processes (tensor_parallel.py) and one torchrun rank
(torchrun.py). The front (llm.py) picks one for its config; the engine only calls it (its
default, a ModelRunner in this process: core/engine.py's start_in_process).
"""

from __future__ import annotations

from typing import Callable, Protocol

from nanovllm.config import Config
from nanovllm.core.sampling import TokenSampler
from nanovllm.core.scheduler import ScheduledBatch
from nanovllm.core.sequence import Sequence


class StepTokens(Protocol):
    """A launched step's sampled tokens, on their way to the host."""

    def result(self) -> list[int]:
        """The tokens, one per sampling row (waits for the device)."""

    def logprobs(self):
        """The step's logprob entries (after result()), or None when no row asked."""


class Executor(Protocol):
    """Runs the model for one engine: its steps, its KV cache and its processes."""

    num_blocks: int  # KV cache blocks (the same on every rank)
    startup_seconds: dict[str, float]  # where the cold start went (bench.py reports it)
    sampler: TokenSampler  # rank 0's sampler: the front registers logits extensions on it

    def launch(self, batch: ScheduledBatch, eos_token_ids: frozenset[int] = frozenset()) -> StepTokens:
        """Queue one step on the device; its tokens arrive through the result."""

    def release(self, seq: Sequence) -> None:
        """A request ended: drop its sampling state."""

    def score(self, token_ids: list[int]):
        """Teacher-forced fp32 logits [len(token_ids), vocab] of one sequence (None on ranks that
        do not hold them), without touching the KV cache."""

    def shutdown(self) -> None:
        """Free the device memory and stop the processes; idempotent."""


# What a front hands the engine: it makes the executor once the engine has its Config.
ExecutorFactory = Callable[[Config], Executor]

