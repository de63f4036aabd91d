"""The one place that wires features into the engine (nanovllm/features/, launch/).

The fronts (llm.py, serve/) call the functions below; each imports a feature only when a config
option, the checkpoint or a request turns it on, so a plain generate loads none of them. Every
function plugs a feature into a hook that core/ or model/ declares: the Executor
(core/executor.py), the ForwardStrategy, logits extensions and scheduling hooks
(core/hooks.py), and what Config.resolve asks of the model's features (config.py's
ModelFeatures, answered by this module's quantization_scheme / kv_scale_calibrator /
sparse_mlp). Function-level imports are this module's purpose: the architecture test allows
them here and nowhere else.
"""

from __future__ import annotations

import nanovllm.core.engine as _engine  # (its load_step_timing is registered at the end)

# ---------------------------------------------------------------- executors, forward strategy, data parallelism


def forward_strategy(config):
    """The piecewise prefill graphs (core/hooks.py's ForwardStrategy), or None (eager prefill)."""
    if config.device != "cuda" or config.enforce_eager or config.prefill_graphs.max_tokens < 1:
        return None
    from nanovllm.features.prefill_graphs import PrefillGraphStrategy, prefill_graph_tokens

    return PrefillGraphStrategy(prefill_graph_tokens(config))


def start_executor(config):
    """What runs the model of LLM's engine (core/executor.py's Executor): a ModelRunner in this
    process, or rank 0 of tensor-parallel workers / this torchrun rank (launch/executors.py)."""
    strategy = forward_strategy(config)
    if config.parallel.tensor_parallel_size == 1 and config.parallel.distributed_executor_backend != "external_launcher":
        from nanovllm.core.engine import start_in_process

        return start_in_process(config, strategy)
    from nanovllm.launch.executors import start_launched_executor

    return start_launched_executor(config, strategy)


def data_parallel_llm(llm_class: type) -> type:
    """The front of LLM(..., data_parallel_size=N) (or the Ray backend): data_parallel_front.py's
    DataParallelLLM over `llm_class`, whose executor is launch/data_parallel.py's ReplicaSet."""
    from nanovllm.data_parallel_front import data_parallel_llm as front

    return front(llm_class)


# ---------------------------------------------------------------- the model's features (Config.resolve)


def quantization_scheme(checkpoint_config, requested: str | None):
    """The weight scheme (model/quant.py's QuantScheme) for `LLM(quantization=...)` and the
    checkpoint's `quantization_config`, or None when neither asks for one."""
    if requested is None and not checkpoint_config:
        return None
    from nanovllm.features.quantization import resolve_quantization

    return resolve_quantization(checkpoint_config, requested)


def kv_scale_calibrator(calculate_kv_scales: bool):
    """The attention layers' KVScaleCalibrator for `LLM(calculate_kv_scales=True)`, else None."""
    if not calculate_kv_scales:
        return None
    from nanovllm.features.quantization.fp8_kv import calibrate_kv_scales

    return calibrate_kv_scales


def sparse_mlp(decoder_options):
    """The MoE block factory (model/decoder.py's SparseMlpFactory: features/moe.py) when the
    model (its DecoderOptions) has mixture-of-experts layers, else None."""
    if not decoder_options.moe_layers:
        return None
    from nanovllm.features.moe import SparseMoeBlock

    return SparseMoeBlock.from_options


def speculation(speculative_config: dict | None, hf_config, tensor_parallel_size: int = 1):
    """LLM(speculative_config=...) checked against the model (features/speculative/options.py), or None."""
    if speculative_config is None:
        return None
    from nanovllm.features.speculative.options import SpeculativeOptions

    return SpeculativeOptions.from_dict(speculative_config, hf_config, tensor_parallel_size)


def lora_adapters(llm, lora_request, n: int) -> list[int] | None:
    """Each prompt's adapter id for `lora_request` (features/lora/front.py), or None for none."""
    if lora_request is None or (isinstance(lora_request, (list, tuple)) and all(r is None for r in lora_request)):
        return None
    from nanovllm.features.lora.front import adapter_ids

    return adapter_ids(llm, lora_request, n)


def adapters(lora_config, hf_config):
    """LLM(enable_lora=True): the factory of each rank's LoRA slots (features/lora/runtime.py), or None."""
    if not lora_config.enable_lora:
        return None
    from nanovllm.features.lora.runtime import LoraRuntime

    return LoraRuntime.factory(lora_config, hf_config)


# ---------------------------------------------------------------- logits extensions


def enable_logits_extensions(sampler, params) -> None:
    """Register on `sampler` (core/sampling.py's TokenSampler) the logits extensions that the
    engine-validated `params` ask for, each once, at its first use, in its logits processing
    (features/logits/processing.py, installed then): a request that asks for none imports none
    of their modules."""
    if params.uses_penalties:
        from nanovllm.features.logits.penalties import Penalties
        from nanovllm.features.logits.processing import logits_processing

        logits_processing(sampler).add_once(Penalties, lambda: Penalties(sampler.device, sampler.pin))
    if params.bias or params.allowed_ids is not None or params.bad_word_ids:
        from nanovllm.features.logits.bias import TokenBias
        from nanovllm.features.logits.processing import logits_processing

        logits_processing(sampler).add_once(TokenBias, lambda: TokenBias(sampler.device, sampler.pin,
                                                                         sampler.prev_tokens))
    if params.logprobs is not None or params.prompt_logprobs is not None:
        from nanovllm.features.logits.logprobs import Logprobs
        from nanovllm.features.logits.processing import logits_processing

        processing = logits_processing(sampler)
        if processing.logprobs is None:
            processing.set_logprobs(Logprobs(sampler.device, sampler.pin))


def tokenize_bad_words(front, params) -> None:
    """The engine's copy `params` of a request with bad_words gets them as token ids
    (features/logits/bias.py), checked against `front`'s tokenizer and vocabulary."""
    if params.bad_word_strings:
        from nanovllm.features.logits.bias import bad_word_ids

        params._set_bad_word_ids(bad_word_ids(front.tokenizer, params.bad_word_strings, front.vocab_size))


def logprob_dicts(llm, entries, tokens, params) -> list:
    """A request's logprobs in vLLM's form (logprob_outputs.py, loaded by the first that has some)."""
    from nanovllm.logprob_outputs import logprob_dicts as dicts

    return dicts(llm, entries, tokens, params)


def enable_structured_outputs(engine, params) -> None:
    """A request's structured_outputs checked and compiled (ValueError before any work), with
    the mask extension on rank 0's sampler (features/structured/masks.py), registered once."""
    if params.structured_outputs is not None:
        from nanovllm.features.structured.masks import StructuredOutputs

        StructuredOutputs.check(engine, params.structured_outputs)


def enable_text_tracking(requests, params, track_text: bool) -> None:
    """Text tracking (features/text_tracking.py: streamed text, stop strings) on `requests` (the
    RequestLifecycle), once, at the first request that streams or has stop strings."""
    if requests.track_text is None and (track_text or params.stop_strings):
        from nanovllm.features.text_tracking import track_text as factory

        requests.track_text = factory


# ---------------------------------------------------------------- scheduling


def wire_scheduling(engine, params=None) -> None:
    """The scheduling features (core/hooks.py) `engine` needs: at start-up (no `params`) those its
    config asks for, else those a request's SamplingParams ask for, once, at the first that does."""
    scheduler = engine.scheduler
    if params is None:
        if engine.config.scheduling.mixed_steps:
            from nanovllm.features.mixed_steps import MixedSteps

            scheduler.policy = MixedSteps()
        if engine.config.speculation is not None:
            from nanovllm.features.speculative.proposers import drafting_hook

            # First: the other hooks see the step as it will run.
            scheduler.hooks.insert(0, drafting_hook(engine))
        if engine.config.lora.enable_lora:
            from nanovllm.features.lora.scheduling import LoraSlots

            scheduler.hooks.append(LoraSlots(engine.config.lora.max_loras, engine.lora_registry))
        return
    wanted = []
    if params.n > 1:
        from nanovllm.features.parallel_sampling import ParallelSampling

        wanted.append(ParallelSampling)
    if params.prompt_logprobs is not None:
        from nanovllm.features.prompt_logprobs import PromptLogprobs

        wanted.append(PromptLogprobs)
    for hook in wanted:
        if not any(isinstance(h, hook) for h in scheduler.hooks):
            scheduler.hooks.append(hook())


def stats_recorder(engine):
    """The statistics of LLM(disable_log_stats=False) (features/stats.py), following requests
    through the scheduler; None by default (no cost)."""
    if engine.config.disable_log_stats:
        return None
    from nanovllm.features.stats import StatsRecorder

    recorder = StatsRecorder(engine)
    engine.scheduler.hooks.append(recorder)
    return recorder


def beam_search(llm, prompts, params, lora_request):
    """LLM.beam_search: features/beam_search.py, loaded at its first use."""
    from nanovllm.features.beam_search import beam_search as search

    return search(llm, prompts, params, lora_request)


# ---------------------------------------------------------------- front APIs a plain generate does not load


def dict_prompt(llm, prompt: dict) -> tuple[list[int], str | None]:
    """LLM's reading of vLLM's prompt dicts (inputs.py, loaded at the first one)."""
    from nanovllm.inputs import dict_prompt as read

    return read(llm, prompt)


def stream(llm, requests, adapters):
    """LLM.stream's iterator over normalized requests (streaming.py, loaded at the first stream)."""
    from nanovllm.streaming import stream_outputs

    return stream_outputs(llm, requests, adapters)


def chat_requests(llm, messages, sampling_params, options: dict, mm_processor_kwargs=None) -> list:
    """LLM.chat's checked requests (chat_template.py, loaded at the first chat)."""
    from nanovllm.chat_template import ChatOptions, chat_requests as requests

    return requests(llm, messages, sampling_params, ChatOptions(**options), mm_processor_kwargs)


def chat_prompt_ids(front, messages, chat_template_kwargs: dict) -> list[int]:
    """LLM.chat_prompt_ids (chat_template.py): the server's rendering of a conversation."""
    from nanovllm.chat_template import chat_prompt_ids as prompt_ids

    return prompt_ids(front, messages, chat_template_kwargs)


def step_api(llm):
    """LLM.llm_engine: vLLM's step API over `llm` (llm_engine.py), loaded at its first use."""
    from nanovllm.llm_engine import LLMEngine

    return LLMEngine(llm)


def add_cli_args(parser):
    """EngineArgs.add_cli_args: `--model` and a flag per LLM option (cli_options.py); returns `parser`."""
    from nanovllm.cli_options import add_cli_args as add

    return add(parser)


def cli_option_values(args) -> dict:
    """EngineArgs.from_cli_args: the LLM options the parsed flags set (cli_options.py)."""
    from nanovllm.cli_options import option_values

    return option_values(args)


def package_attribute(name: str):
    """`nanovllm.LLMEngine` (vLLM's step API), loaded when first named: the package's __getattr__
    asks here."""
    if name == "LLMEngine":
        from nanovllm.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")


# ---------------------------------------------------------------- slim4a: what the plain path's front modules load late

import nanovllm.outputs as _outputs  # noqa: E402 (registered into below)
import nanovllm.sampling_params as _sampling_params  # noqa: E402


def sampling_checks():
    """sampling_params.py's FeatureChecks (features/sampling_checks.py), loaded by the first
    SamplingParams that sets a feature field or names a vLLM field nano-vllm lacks."""
    from nanovllm.features import sampling_checks as checks

    return checks


_sampling_params.FEATURE_CHECKS.append(sampling_checks)


def llm_calls():
    """llm_calls.py: what LLM's calls need only at times (a progress bar, a call cut short)."""
    import nanovllm.llm_calls as calls

    return calls


def output_type(name: str) -> type:
    """outputs.py's types that a plain generate never makes: StreamOutput (streaming.py), Logprob
    and its list types (logprob_outputs.py)."""
    if name == "StreamOutput":
        from nanovllm.streaming import StreamOutput

        return StreamOutput
    import nanovllm.logprob_outputs as logprob_outputs

    return getattr(logprob_outputs, name)


_outputs.LATE_TYPES.append(output_type)


# ---------------------------------------------------------------- slim4b: the engine's rarely run paths


def check_processes(config, hf_config) -> None:
    """Config.resolve's check that an engine of several processes fits the model and this node's
    GPUs (launch/fit.py)."""
    if config.parallel.tensor_parallel_size * config.parallel.data_parallel_size > 1:
        from nanovllm.launch.fit import check_processes as check

        check(config, hf_config)


def step_timing():
    """core/step_timing.py, loaded at the first step an engine's step_observers watch: the loader
    core/engine.py calls (registered below when the package loads)."""
    from nanovllm.core import step_timing as module

    return module


_engine.load_step_timing = step_timing


# ---------------------------------------------------------------- slim4c: what a plain CPU generate never runs
# Registered into the core's hooks at import (nanovllm/__init__.py imports this module first): each
# loads its module at its first use.

import nanovllm.core.model_runner as _model_runner  # noqa: E402
import nanovllm.model.attention.paged_kv as _paged_kv  # noqa: E402
import nanovllm.model.decoder as _decoder  # noqa: E402


def cuda_runtime():
    """What only a CUDA engine's model runner runs (core/cuda_runtime.py: the attention backend's
    choice, the GPU's KV budget, the decode graphs, the Triton sampler)."""
    import nanovllm.core.cuda_runtime as runtime

    return runtime


def runner_extras():
    """What a model runner runs only when asked (core/runner_extras.py: score(), dummy weights)."""
    import nanovllm.core.runner_extras as extras

    return extras


def llama3_rope_scaling():
    """Llama 3's RoPE scaling (model/rope_scaling.py), for a config.json with rope_type "llama3"."""
    from nanovllm.model.rope_scaling import Llama3RopeScaling

    return Llama3RopeScaling


def fp8_cache():
    """The FP8 KV cache's encoding in plain torch (model/attention/fp8_cache.py), for an FP8 cache."""
    import nanovllm.model.attention.fp8_cache as codec

    return codec


_model_runner.CUDA_RUNTIME, _model_runner.RUNNER_EXTRAS = cuda_runtime, runner_extras
_decoder.LLAMA3_ROPE_SCALING, _paged_kv.FP8_CACHE = llama3_rope_scaling, fp8_cache


# ---------------------------------------------------------------- s7engine: the engine's refusals and aborts
def engine_extras():
    """What the engine runs only at times (core/engine_extras.py: a refused request, an abort)."""
    import nanovllm.core.engine_extras as extras

    return extras


_engine.EXTRAS = engine_extras
