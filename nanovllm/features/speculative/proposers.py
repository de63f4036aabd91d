"""The drafting hook of an engine, with the proposer its speculative_config names."""

from __future__ import annotations

from nanovllm.features.speculative.draft_model import DraftModelProposer
from nanovllm.features.speculative.drafting import Drafting
from nanovllm.features.speculative.ngram import NgramProposer


def drafting_hook(engine) -> Drafting:
    """The Drafting SchedulingHook for `engine` (an LLM whose config.speculation is set)."""
    options, config = engine.config.speculation, engine.config
    if options.method == "draft_model":
        proposer = DraftModelProposer(options, config, engine.model_runner.num_blocks)
    else:
        proposer = NgramProposer(options.prompt_lookup_min, options.prompt_lookup_max)
    return Drafting(options, proposer, config.max_model_len)
