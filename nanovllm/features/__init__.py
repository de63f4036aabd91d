"""Features: each a module or small package that plugs into a hook the core declares
(`nanovllm/core/hooks.py`, the `Executor` in `core/executor.py`, the linear method and attention
backend protocols in `model/`).

This file is the one place that wires them: the fronts call the functions below, which import a
feature only when a config option or a request turns it on, so a plain generate loads none.
"""


def wire_scheduling(engine, params=None) -> None:
    """The scheduling features (core/hooks.py) `engine` needs. At start-up (no `params`): mixed
    steps when config.mixed_steps asks. For a request's SamplingParams: parallel sampling
    (n > 1) and prompt logprobs, registered once, by the first request that asks for them."""
    scheduler = engine.scheduler
    if params is None:
        if engine.config.mixed_steps:
            from nanovllm.features.mixed_steps import MixedSteps

            scheduler.policy = MixedSteps()
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
