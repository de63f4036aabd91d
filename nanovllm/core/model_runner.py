"""Runs the model for one scheduled batch on one tensor-parallel rank, and samples.

The runner composes small parts: the model and its weights, the paged KV cache (kv_cache.py), the
packing of a batch into input tensors (step_inputs.py), an optional forward strategy for prefill
steps (hooks.py), the sampler that keeps each step's tokens on the device and sends them to the
host in the background (sampling.py), and on CUDA the decode graphs (cuda_runtime.py). In one
process it is the engine's Executor (executor.py); launch/'s executors drive one per rank.
Overlap scheduling: `launch` returns once the step is queued; the next step takes the input tokens
the host has not seen yet straight from the device (StepInput.src_rows).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from typing import TYPE_CHECKING, Callable

import torch

from nanovllm.config import Config
from nanovllm.core.kv_cache import KVCacheSpec, allocate_kv_cache, blocks_that_fit
from nanovllm.core.sampling import PendingTokens, TokenSampler
from nanovllm.core.scheduler import ScheduledBatch
from nanovllm.core.step_inputs import StepInput, StepInputs
from nanovllm.model.attention import Attention
from nanovllm.model.attention.torch_backend import TorchBackend
from nanovllm.model.loader import load_model
from nanovllm.model.registry import model_class
from nanovllm.parallel.group import TPGroup, use_tp_group

if TYPE_CHECKING:
    from types import ModuleType

    from nanovllm.core.hooks import AfterSampling, ForwardStrategy

logger = logging.getLogger(__name__)

# What only a CUDA engine runs (core/cuda_runtime.py: the attention backend's choice, the GPU's KV
# budget, the decode graphs, the Triton sampler), and what runs only when asked (core/runner_extras.py:
# score(), dummy weights, features' set-up, forked samples): nanovllm/wiring/ registers their loaders.
CUDA_RUNTIME: Callable[[], ModuleType] | None = None
RUNNER_EXTRAS: Callable[[], ModuleType] | None = None


class ModelRunner:
    """The model, its KV cache, its CUDA graphs and its sampler on one tensor-parallel rank.
    `launch(batch)` is one engine step on a single rank; with tensor parallelism every rank calls
    `execute(step)`, then every rank samples its vocabulary shard (StepInput.sampling) or rank 0
    the gathered logits (launch/tensor_parallel.py)."""

    def __init__(self, config: Config, forward_strategy: ForwardStrategy | None = None, tp: TPGroup | None = None):
        """`forward_strategy`: how prefill steps may run other than eagerly (None: eagerly);
        `tp`: this rank's tensor-parallel group (the launcher's; None: a single rank)."""
        self.config = config
        t0 = time.perf_counter()
        self.device = torch.device("cuda", torch.cuda.current_device()) if config.device == "cuda" \
            else torch.device("cpu")
        self.tp = tp if tp is not None else TPGroup()
        self.world_size, self.rank = self.tp.size, self.tp.rank
        self.model = self._build_model()
        self.adapters = None  # per-request adapters (LoRA): attached before memory is measured
        if config.speculation is not None or config.adapters is not None:
            RUNNER_EXTRAS().prepare_features(self)
        self.after_sampling: list[AfterSampling] = []
        self.forward_inputs = None  # (positions, metadata) of the last forward, for after_sampling
        t_weights = time.perf_counter()

        cuda = CUDA_RUNTIME() if self.device.type == "cuda" else None
        # A CPU engine runs the torch backend, the only one its config allows there.
        self.backend = TorchBackend() if cuda is None else cuda.select_backend(
            config.device, config.kvcache_block_size, config.attention_backend, config.kv_dtype)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.attn_layers:
            layer.backend = self.backend
        spec = KVCacheSpec(len(self.attn_layers), config.kvcache_block_size, self.attn_layers[0].num_kv_heads,
                           self.attn_layers[0].head_dim, config.kv_dtype)
        max_blocks_per_seq = math.ceil(config.max_model_len / config.kvcache_block_size)
        gpu_blocks = cuda and functools.partial(cuda.blocks_from_gpu_budget, self, forward_strategy)
        num_blocks = blocks_that_fit(config, spec, max_blocks_per_seq, gpu_blocks)
        self.num_blocks = self.tp.agree_on_min(num_blocks, self.device)  # every rank holds the same blocks
        self.kv_cache = allocate_kv_cache(spec, self.num_blocks, self.attn_layers, self.device)
        t_kv = time.perf_counter()

        max_rows = max(config.max_num_seqs, 1)
        self.inputs = StepInputs(max_rows, max_blocks_per_seq, config.kvcache_block_size, self.device,
                                 self.backend.name, spec.num_kv_heads)
        self.sampler = TokenSampler(max_rows, self.device, self.tp, cuda and cuda.TritonSampler())
        self.graphs = self.forward_strategy = None  # (decode graphs, prefill graphs: on CUDA)
        self.graph_pool_bytes = 0  # what capturing the graphs added to the allocator's reserve
        if cuda is not None:
            cuda.capture_graphs(self, forward_strategy)
        if config.kv_calibrator is not None:  # after the warm-ups and captures, which ran on no real data
            RUNNER_EXTRAS().arm_kv_calibration(self)
        # Where the cold start goes (bench.py reports it).
        self.startup_seconds = {"model": round(t_weights - t0, 2), "kv_cache": round(t_kv - t_weights, 2),
                                "cuda_graphs": round(time.perf_counter() - t_kv, 2)}
        logger.info("model runner ready: %s seconds; graphs reserved %.0f MiB", self.startup_seconds,
                    self.graph_pool_bytes / 2**20)

    def _build_model(self):
        """The model with this rank's shard of the weights (from the checkpoint, or random)."""
        config = self.config
        # Build the parameters directly in the target dtype on the device (no fp32 copy first).
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.dtype)
        try:
            with torch.device(self.device), use_tp_group(self.tp):
                model = model_class(config.hf_config)(config.hf_config, max_positions=config.max_model_len,
                                                      sparse_mlp=config.sparse_mlp)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.quant is not None:
            config.quant.quantize(model)
        for layer in model.modules():
            if isinstance(layer, Attention):
                layer.fp8_kv_cache = config.kv_dtype == torch.float8_e4m3fn  # the loader takes its scales then
        if config.load_format == "dummy":
            RUNNER_EXTRAS().init_dummy(model, config.seed, config.quant)
        else:
            load_model(model, config.model)
        if config.quant is not None:
            config.quant.finish_loading(model)
        return model

    # ------------------------------------------------------------------ a step
    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, eos_token_ids: frozenset[int] = frozenset()) -> PendingTokens:
        """Queue one step and its sampling on the device; the tokens arrive via the result. The
        sampling may wait for the next launch (TokenSampler.flush) while a logits extension does
        host work, unless after_sampling hooks read the tokens right after."""
        self.sampler.flush()
        step = StepInput.from_batch(batch)
        logits = self.execute(step)
        pending = self.sampler.sample(logits, batch.rows, eos_token_ids, step=step, defer=not self.after_sampling)
        for hook in self.after_sampling:
            hook.after_sampling(self, batch, step)
        return pending

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor | None:
        """The model part of a step, which every tensor-parallel rank runs: logits of each
        sampling row (each sequence's last new token, then the samples forked in this step) and
        of the prompt-logprob positions (rank 0), or None (other ranks); with `step.sampling`,
        the sampled tokens instead (every rank, also left in the sampler's device buffer)."""
        if step.src_rows is not None and self.world_size > 1 and step.sync_prev:
            self.sampler.share_previous()
        every = None  # prefill: the hidden state of every packed token
        if self.adapters is not None:
            self.adapters.prepare(step)
        if step.is_prefill:
            ids, pos, meta, last = self.inputs.prefill(step, self.sampler.input_tokens)
            strategy = self.forward_strategy
            if strategy is not None and strategy.runs_prefill(ids.numel()):
                every = strategy.run_prefill(ids, pos, meta)
            else:
                every = self.model(ids, pos, meta)
            self.forward_inputs = (pos, meta)
            hidden = every[last]
            if not step.prompt_rows:
                every = None  # (free it before the LM head, as before prompt logprobs existed)
        else:
            n = len(step.token_ids)
            graph_bs = self.graphs.batch_size_for(n) if self.graphs is not None else None
            if graph_bs is None:
                ids, pos, meta = self.inputs.decode(step, n, self.sampler.input_tokens)
                hidden = self.model(ids, pos, meta)
                self.forward_inputs = (pos, meta)
            else:
                hidden = self.graphs.replay(step, graph_bs)
                self.forward_inputs = self.graphs.inputs_of[graph_bs]
        if step.fork_rows or step.prompt_rows:
            hidden = RUNNER_EXTRAS().extra_rows(self, hidden, step, every)
        if step.block_copies:  # after the forward wrote the source blocks
            RUNNER_EXTRAS().copy_blocks(self.kv_cache, step.block_copies, self.device)
        if step.sampling is not None:
            return step.sampling.sample(self.sampler, self.model, hidden)
        return self.model.compute_logits(hidden)

    def release(self, seq) -> None:
        """A request ended: drop its sampling state (penalty counts) on this rank."""
        self.sampler.release(seq)

    # ------------------------------------------------------------------ scoring (tests): core/runner_extras.py
    def check_score_input(self, token_ids: list[int]) -> None:
        RUNNER_EXTRAS().check_score_input(self.config, token_ids)

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits [len(token_ids), vocab] (fp32; None on ranks other than 0) of one
        sequence, without touching the KV cache. Used to check the model against a reference."""
        return RUNNER_EXTRAS().score(self, token_ids)

    def shutdown(self, synchronize: bool = True) -> None:
        """Release the KV cache, graphs and weights (GPU memory goes back to the allocator).
        synchronize=False when a kernel may never finish (a TP peer died and NCCL's abort hung):
        then the memory stays cached rather than wait for the device."""
        self.graphs = self.forward_strategy = None
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.kv_cache = self.model = None
        if self.device.type == "cuda" and synchronize:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
