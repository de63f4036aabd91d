"""`LLM(speculative_config={...})`, in vLLM's keys, checked before any weight loads."""

from __future__ import annotations

from dataclasses import dataclass

from nanovllm.limits import clip_repr
from nanovllm.values import is_integer

METHODS = ("ngram",)
# vLLM methods that nano-vllm does not run (yet): named in the error.
NOT_IMPLEMENTED = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "deepseek_mtp", "mtp")
KEYS = frozenset({"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                  "draft_tensor_parallel_size", "disable_by_batch_size"})
# Decode rows above which no step drafts: a verification step runs the prefill path (no decode
# CUDA graph, no overlap with the host), which pays only while steps are bound by the weights.
DEFAULT_DISABLE_BY_BATCH_SIZE = 32
# At most this many tokens (rows x (1 + drafts)) in a drafting step: fewer drafts per row as the
# batch grows, so a verification step stays about as cheap as a decode step.
DRAFT_TOKEN_BUDGET = 64


def _positive(options: dict, key: str, default=None) -> int | None:
    value = options.get(key, default)
    if value is None:
        return None
    if not is_integer(value) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config[{key!r}]={clip_repr(value)}: must be an integer >= 1")
    return int(value)


@dataclass(frozen=True)
class SpeculativeOptions:
    """The checked options: method, num_speculative_tokens (k, the most drafts per row and
    step), the n-gram sizes prompt lookup matches (longest first), and disable_by_batch_size."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int

    @classmethod
    def from_dict(cls, options) -> "SpeculativeOptions":
        if not isinstance(options, dict):
            raise ValueError(f"speculative_config={clip_repr(options)}: must be a dict of vLLM's keys")
        unknown = sorted(set(options) - KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                             f"{', '.join(sorted(KEYS))}")
        method = options.get("method")
        if method is None and options.get("model") in ("ngram", "[ngram]"):
            method = "ngram"  # vLLM's older spelling
        if method in NOT_IMPLEMENTED:
            raise NotImplementedError(f"speculative_config['method']={method!r} is not supported by nano-vllm yet; "
                                      f"supported: {', '.join(METHODS)}")
        if method not in METHODS:
            raise ValueError(f"speculative_config['method']={clip_repr(method)}: must be one of {', '.join(METHODS)}")
        k = _positive(options, "num_speculative_tokens")
        if k is None:
            raise ValueError("speculative_config needs 'num_speculative_tokens' (an integer >= 1)")
        low, high = _positive(options, "prompt_lookup_min"), _positive(options, "prompt_lookup_max")
        low, high = low or high or 5, high or low or 5  # vLLM's: one given sets both; default 5
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min={low} is above prompt_lookup_max={high}")
        tp = _positive(options, "draft_tensor_parallel_size", 1)
        if tp != 1:
            raise ValueError("speculative_config['draft_tensor_parallel_size'] applies to a draft model; "
                             "the 'ngram' method has none")
        disable = _positive(options, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
        return cls(method, k, low, high, disable)

    def drafts_per_row(self, num_rows: int, max_rows: int) -> int:
        """How many tokens each of `num_rows` decode rows may draft this step: k at small batch,
        fewer as rows x (1 + drafts) reaches DRAFT_TOKEN_BUDGET or `max_rows` (the sampling rows a
        step may have), none past disable_by_batch_size."""
        if num_rows > self.disable_by_batch_size:
            return 0
        budget = min(DRAFT_TOKEN_BUDGET, max_rows)
        return max(0, min(self.num_speculative_tokens, budget // max(num_rows, 1) - 1))
