"""vLLM's `LLM(...)` keywords that nano-vllm names otherwise (`block_size`) or does without: a
value whose meaning nano-vllm has anyway is accepted (`enable_chunked_prefill=True`: long prompts
are always split into chunks), another is a NotImplementedError saying why (Config.from_kwargs)."""

from __future__ import annotations

# vLLM's name -> nano-vllm's.
VLLM_ALIASES = {"block_size": "kvcache_block_size"}
# vLLM keywords nano-vllm does without: the values that mean what nano-vllm does anyway, and why
# any other cannot be honoured.
VLLM_ONLY_DEFAULTS = {
    "enable_chunked_prefill": ((None, True), "nano-vllm always splits a long prompt into chunks of "
                               "max_num_batched_tokens tokens (as vLLM V1 does)"),
    "swap_space": ((None, 0), "nano-vllm preempts a request by recompute: it never swaps KV blocks to the CPU"),
    "compilation_config": ((None, 0, {}), "nano-vllm does not use torch.compile: its CUDA graphs follow "
                           "enforce_eager and max_prefill_graph_tokens"),
}


def translate_vllm_keywords(kwargs: dict) -> dict:
    """LLM's keywords with vLLM's names mapped onto nano-vllm's, the vLLM-only ones checked and dropped."""
    out = dict(kwargs)
    for theirs, ours in VLLM_ALIASES.items():
        if theirs in out:
            value = out.pop(theirs)
            if ours in out and out[ours] != value:
                raise ValueError(f"{theirs}={value!r} (vLLM's name) and {ours}={out[ours]!r} disagree: give one")
            out[ours] = value
    for name, (accepted, why) in VLLM_ONLY_DEFAULTS.items():
        if name in out:
            value = out.pop(name)
            if not any(value is a or (type(value) is type(a) and value == a) for a in accepted):
                raise NotImplementedError(f"{name}={value!r}: {why}; leave it out (or at "
                                          f"{' / '.join(map(repr, accepted[1:]))})")
    return out
