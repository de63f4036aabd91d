"""The longer pluggings of nanovllm/wiring/ (logits extensions, scheduling hooks, statistics),
loaded by the first engine or request that asks for one: the package's functions check first."""

from __future__ import annotations


def enable_logits_extensions(sampler, params) -> None:
    """Each extension `params` asks for, registered once, at its first use, in the sampler's
    logits processing (features/logits/processing.py, installed then)."""
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


def wire_scheduling(engine, params=None) -> None:
    """The scheduling hooks: at start-up (no `params`) those the config asks for, else those the
    request's SamplingParams ask for, each once."""
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
    """LLM(disable_log_stats=False)'s StatsRecorder (features/stats.py), following requests
    through the scheduler's hooks."""
    from nanovllm.features.stats import StatsRecorder

    recorder = StatsRecorder(engine)
    engine.scheduler.hooks.append(recorder)
    return recorder
