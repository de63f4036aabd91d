"""What `LLM.generate` / `chat` / `stream` return: vLLM's output types, which also read as
nano-vllm's dicts (`out["text"]`: see RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from nanovllm.logprob_outputs import PromptLogprobs, SampleLogprobs
    from nanovllm.metrics import RequestMetrics

# Logprob (logprob_outputs.py) and StreamOutput (streaming.py), which a plain generate never makes,
# load when first named: wiring/ registers the loader.
LATE_TYPES: list[Callable[[str], type]] = []


def __getattr__(name: str):
    if name not in ("Logprob", "SampleLogprobs", "PromptLogprobs", "StreamOutput"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return LATE_TYPES[0](name)


@dataclass
class CompletionOutput:
    """One of a request's `n` completions (vLLM's CompletionOutput). cumulative_logprob and logprobs
    are None unless `logprobs` was asked for; finish_reason: "stop" | "length" | "abort" (None while
    running); stop_reason: the stop string or token id that ended it, None for EOS, length or abort."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class RequestOutput(dict):
    """The outputs of one prompt (vLLM's RequestOutput; `metrics` with disable_log_stats=False). Also
    nano-vllm's dict, read-only in intent: `out["text"]`, `["token_ids"]`, `["finish_reason"]` and
    `["stop_reason"]` read the first completion, `out["prompt_token_ids"]` the prompt's tokens."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)

    def __post_init__(self):
        first = self.outputs[0] if self.outputs else CompletionOutput(0, "", [])
        self.update(text=first.text, token_ids=first.token_ids, finish_reason=first.finish_reason,
                    stop_reason=first.stop_reason, prompt_token_ids=self.prompt_token_ids)

    def __eq__(self, other):
        if isinstance(other, RequestOutput):
            return type(self) is type(other) and vars(self) == vars(other)
        return dict.__eq__(self, other)  # against a plain dict: nano-vllm's form

    def __ne__(self, other):
        return not self == other


__all__ = ["CompletionOutput", "Logprob", "PromptLogprobs", "RequestOutput", "SampleLogprobs", "StreamOutput"]
