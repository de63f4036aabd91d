"""Features: each a module or small package that plugs into a hook the core declares
(`nanovllm/core/hooks.py`, the `Executor` in `core/executor.py`, the linear method and attention
backend protocols in `model/`).

This file is the one place that wires them: the fronts call the functions below, which import a
feature only when a config option or a request turns it on, so a plain generate loads none.
"""


def enable_logits_extensions(sampler, params) -> None:
    """Register on `sampler` (core/sampling.py's TokenSampler) the logits extensions that the
    engine-validated `params` ask for, each once, at its first use: penalties, allowed ids / bad
    words / logit_bias, logprobs (of the samples or the prompt). A request that asks for none
    imports none of their modules."""
    if params.uses_penalties:
        from nanovllm.features.logits.penalties import Penalties

        if not any(isinstance(e, Penalties) for e in sampler.extensions):
            sampler.add_extension(Penalties(sampler.device, sampler.pin))
    if params.bias or params.allowed_ids is not None or params.bad_word_ids:
        from nanovllm.features.logits.bias import TokenBias

        if not any(isinstance(e, TokenBias) for e in sampler.extensions):
            sampler.add_extension(TokenBias(sampler.device, sampler.pin, sampler.prev_tokens))
    if sampler.logprobs is None and (params.logprobs is not None or params.prompt_logprobs is not None):
        from nanovllm.features.logits.logprobs import Logprobs

        sampler.set_logprobs(Logprobs(sampler.device, sampler.pin))
