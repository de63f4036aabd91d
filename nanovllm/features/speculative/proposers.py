"""The drafting hook of an engine, with the proposer its speculative_config names; it also
verifies the drafts (the engine's DraftVerifier)."""

from __future__ import annotations

from nanovllm.features.speculative.draft_model import DraftModelProposer
from nanovllm.features.speculative.drafting import Drafting
from nanovllm.features.speculative.eagle3 import Eagle3Proposer
from nanovllm.features.speculative.ngram import NgramProposer
from nanovllm.features.speculative.synthetic import SyntheticAcceptance


def drafting_hook(engine) -> Drafting:
    """The Drafting SchedulingHook for `engine` (an LLM whose config.speculation is set)."""
    options, config = engine.config.speculation, engine.config
    if options.method == "draft_model":
        proposer = DraftModelProposer(options, config, engine.model_runner.num_blocks)
    elif options.method == "eagle3":
        proposer = Eagle3Proposer(options, engine.model_runner)
        engine.model_runner.after_sampling.append(proposer)  # (its half after every target step)
    else:  # (synthetic acceptance: always k drafts, whatever the lookup finds)
        proposer = NgramProposer(options.prompt_lookup_min, options.prompt_lookup_max,
                                 pad=options.synthetic_rates is not None)
    acceptance = SyntheticAcceptance(options.synthetic_rates) if options.synthetic_rates is not None else None
    engine.requests.verifier = Drafting(options, proposer, config.max_model_len, engine.block_manager, acceptance)
    return engine.requests.verifier
