"""The one place that wires features (nanovllm/features/, launch/) into the hooks core/ and model/
declare, each imported only when a config option, the checkpoint or a request turns it on: a plain
generate loads none. Config.resolve asks this module for the model's features (core/hooks.py's
ModelFeatures); the slots of core/ and model/ get `late` loaders at import. What only a front API
runs (chat, stream, beam search, ...) is in fronts.py, served from here when first named; the longer
pluggings are in plugging.py. Deferred imports are allowed here only (tests/test_architecture.py)."""

from __future__ import annotations

from functools import cache
from importlib import import_module
from typing import Any, Callable

import nanovllm.config as _config
import nanovllm.core.block_manager as _block_manager
import nanovllm.core.engine as _engine
import nanovllm.core.model_runner as _model_runner
import nanovllm.core.sampler as _sampler
import nanovllm.core.scheduler as _scheduler
import nanovllm.limits as _limits
import nanovllm.model.attention.paged_kv as _paged_kv
import nanovllm.model.checkpoint as _checkpoint
import nanovllm.model.decoder as _decoder
import nanovllm.model.loader as _loader
import nanovllm.outputs as _outputs
import nanovllm.sampling_params as _sampling_params


def late(module: str, attribute: str = "") -> Callable[[], Any]:
    """A loader of `module` (or its `attribute`), imported at its first call and kept (per-step callers)."""

    @cache
    def load():
        loaded = import_module(module)
        return getattr(loaded, attribute) if attribute else loaded

    return load


_plugging = late("nanovllm.wiring.plugging")  # (not `plugging`: importing the module sets that name)


def __getattr__(name: str):
    """fronts.py's loaders (chat, stream, beam search, step API, ...), loaded when first named."""
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module("nanovllm.wiring.fronts"), name)


# ---------------------------------------------------------------- core/ and model/ slots, filled at import

_sampling_params.FEATURE_CHECKS.append(late("nanovllm.features.sampling_checks"))  # a feature field set
_engine.load_step_timing = late("nanovllm.core.step_timing")  # the first step that step_observers watch
_model_runner.CUDA_RUNTIME = late("nanovllm.core.cuda_runtime")  # backend choice, KV budget, graphs (CUDA)
_model_runner.RUNNER_EXTRAS = late("nanovllm.core.runner_extras")  # score(), dummy weights, features' set-up
_decoder.LLAMA3_ROPE_SCALING = late("nanovllm.model.rope_scaling", "Llama3RopeScaling")  # rope_type "llama3"
_paged_kv.FP8_CACHE = late("nanovllm.model.attention.fp8_cache")  # an FP8 KV cache's encoding
_sampler.RANDOM_DRAW = late("nanovllm.core.random_draw")  # temperature > 0
_engine.EXTRAS = late("nanovllm.core.engine_extras")  # a refused request, an abort, a failed step
_config.CONFIG_CHECKS = late("nanovllm.config_checks")  # checks a plain engine never runs
_limits.QUOTES = late("nanovllm.quotes")  # the first error message quoting a value
_decoder.FUSED_QK_NORM_ROPE = late("nanovllm.model.fused_qk_norm_rope")  # the fused q/k norm + RoPE (CUDA)
_decoder.NORM_CHAIN = late("nanovllm.model.norm_chain")  # batch 1 on CUDA: norms folded into the GEMVs
_loader.KV_SCALES = late("nanovllm.model.kv_scales")  # an FP8 checkpoint's k/v scales
_checkpoint.HUB = late("nanovllm.model.hub")  # a Hugging Face Hub id
_block_manager.PREFIX_CACHE = late("nanovllm.core.prefix_cache")  # a lookup with blocks cached, a full block
_block_manager.KV_USAGE = late("nanovllm.core.kv_usage")  # LLMEngine.kv_usage (stats, bench)
_scheduler.PREEMPTION = late("nanovllm.core.preemption")  # a decode finds no free block


def output_type(name: str) -> type:
    """outputs.py's late types: StreamOutput (streaming.py), Logprob and its lists (logprob_outputs.py)."""
    return getattr(import_module("nanovllm.streaming" if name == "StreamOutput" else "nanovllm.logprob_outputs"), name)


_outputs.LATE_TYPES.append(output_type)

# ---------------------------------------------------------------- executors, forward strategy


def forward_strategy(config):
    """The piecewise prefill graphs (core/hooks.py's ForwardStrategy), or None (eager prefill)."""
    if config.device != "cuda" or config.enforce_eager or config.prefill_graphs.max_tokens < 1:
        return None
    graphs = import_module("nanovllm.features.prefill_graphs")
    return graphs.PrefillGraphStrategy(graphs.prefill_graph_tokens(config))


def start_executor(config):
    """LLM's Executor (core/executor.py): a ModelRunner here, or TP workers / a torchrun rank (launch/)."""
    strategy = forward_strategy(config)
    if config.parallel.tensor_parallel_size == 1 and config.parallel.distributed_executor_backend != "external_launcher":
        return _engine.start_in_process(config, strategy)
    return import_module("nanovllm.launch.executors").start_launched_executor(config, strategy)


# ---------------------------------------------------------------- the model's features (Config.resolve)


def quantization_scheme(checkpoint_config, requested: str | None):
    """The QuantScheme (model/quant.py) `quantization=` or the checkpoint's config asks for, else None."""
    if requested is None and not checkpoint_config:
        return None
    return import_module("nanovllm.features.quantization").resolve_quantization(checkpoint_config, requested)


def kv_scale_calibrator(calculate_kv_scales: bool):
    """The attention layers' KVScaleCalibrator for `LLM(calculate_kv_scales=True)`, else None."""
    return import_module("nanovllm.features.quantization.fp8_kv").calibrate_kv_scales if calculate_kv_scales else None


def sparse_mlp(decoder_options):
    """The MoE block factory (model/decoder.py's SparseMlpFactory: features/moe.py) for MoE layers, else None."""
    if not decoder_options.moe_layers:
        return None
    return import_module("nanovllm.features.moe").SparseMoeBlock.from_options


def speculation(speculative_config: dict | None, hf_config, tensor_parallel_size: int = 1):
    """LLM(speculative_config=...) checked against the model (features/speculative/options.py), or None."""
    if speculative_config is None:
        return None
    options = import_module("nanovllm.features.speculative.options").SpeculativeOptions
    return options.from_dict(speculative_config, hf_config, tensor_parallel_size)


def adapters(lora_config, hf_config):
    """LLM(enable_lora=True): the factory of each rank's LoRA slots (features/lora/runtime.py), or None."""
    if not lora_config.enable_lora:
        return None
    return import_module("nanovllm.features.lora.runtime").LoraRuntime.factory(lora_config, hf_config)


def check_processes(config, hf_config) -> None:
    """Config.resolve's check that several processes fit the model and this node's GPUs (launch/fit.py)."""
    if config.parallel.tensor_parallel_size * config.parallel.data_parallel_size > 1:
        import_module("nanovllm.launch.fit").check_processes(config, hf_config)


# ---------------------------------------------------------------- what a request asks for (plugging.py)


def lora_adapters(llm, lora_request, n: int) -> list[int] | None:
    """Each prompt's adapter id for `lora_request` (features/lora/front.py), or None for none."""
    if lora_request is None or (isinstance(lora_request, (list, tuple)) and all(r is None for r in lora_request)):
        return None
    return import_module("nanovllm.features.lora.front").adapter_ids(llm, lora_request, n)


def enable_logits_extensions(sampler, params) -> None:
    """Register on `sampler` (core/sampling.py's TokenSampler) the logits extensions that the
    engine-validated `params` ask for, each once, at its first use: a request that asks for none
    imports none of their modules."""
    if (params.uses_penalties or params.bias or params.allowed_ids is not None or params.bad_word_ids
            or params.logprobs is not None or params.prompt_logprobs is not None):
        _plugging().enable_logits_extensions(sampler, params)


def tokenize_bad_words(front, params) -> None:
    """The engine's copy `params` of a request with bad_words gets them as token ids
    (features/logits/bias.py), checked against `front`'s tokenizer and vocabulary."""
    if params.bad_word_strings:
        bad_word_ids = import_module("nanovllm.features.logits.bias").bad_word_ids
        params._set_bad_word_ids(bad_word_ids(front.tokenizer, params.bad_word_strings, front.vocab_size))


def enable_structured_outputs(engine, params) -> None:
    """A request's structured_outputs checked and compiled (ValueError before any work), with
    the mask extension on rank 0's sampler (features/structured/masks.py), registered once."""
    if params.structured_outputs is not None:
        import_module("nanovllm.features.structured.masks").StructuredOutputs.check(engine, params.structured_outputs)


def enable_text_tracking(requests, params, track_text: bool) -> None:
    """Text tracking (features/text_tracking.py: streamed text, stop strings) on `requests` (the
    RequestLifecycle), once, at the first request that streams or has stop strings."""
    if requests.track_text is None and (track_text or params.stop_strings):
        requests.track_text = import_module("nanovllm.features.text_tracking").track_text


def wire_scheduling(engine, params=None) -> None:
    """The scheduling features (core/hooks.py) `engine` needs: at start-up (no `params`) those its
    config asks for, else those a request's SamplingParams ask for, once, at the first that does."""
    config = engine.config
    if params is None:
        wanted = config.scheduling.mixed_steps or config.speculation is not None or config.lora.enable_lora
    else:
        wanted = params.n > 1 or params.prompt_logprobs is not None
    if wanted:
        _plugging().wire_scheduling(engine, params)


def stats_recorder(engine):
    """The statistics of LLM(disable_log_stats=False) (features/stats.py), following requests
    through the scheduler; None by default (no cost)."""
    return None if engine.config.disable_log_stats else _plugging().stats_recorder(engine)
