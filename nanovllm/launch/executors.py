"""launch/'s executors (core/executor.py's protocol), picked by the config: rank 0 of
tensor-parallel worker processes (tensor_parallel.py), or one torchrun rank (torchrun.py)."""

from __future__ import annotations

from nanovllm.config import Config
from nanovllm.core.executor import Executor
from nanovllm.core.hooks import ForwardStrategy
from nanovllm.launch.tensor_parallel import TensorParallelRunner
from nanovllm.launch.torchrun import ExternalLauncherRunner


def start_launched_executor(config: Config, forward_strategy: ForwardStrategy | None) -> Executor:
    """The executor of an engine whose model is split over several processes; every rank runs
    `forward_strategy` (a fresh copy in each worker)."""
    if config.parallel.distributed_executor_backend == "external_launcher":
        return ExternalLauncherRunner(config, forward_strategy)
    return TensorParallelRunner(config, forward_strategy)
