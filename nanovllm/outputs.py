"""What `LLM.generate` / `chat` / `stream` return: vLLM's output types, which also read as
nano-vllm's dicts (`out["text"]`: see RequestOutput). The dict holds the values an output was made
with: a read-only view in intent, like the object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from nanovllm.logprob_outputs import PromptLogprobs, SampleLogprobs

# Logprob (logprob_outputs.py) and StreamOutput (streaming.py), which a plain generate never makes,
# load when first named: wiring.py registers the loader.
LATE_TYPES: list[Callable[[str], type]] = []


def __getattr__(name: str):
    if name not in ("Logprob", "SampleLogprobs", "PromptLogprobs", "StreamOutput"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return LATE_TYPES[0](name)


@dataclass
class CompletionOutput:
    """One of a request's `n` completions (vLLM's CompletionOutput).

    index: which sample (0 .. n-1); text: the generated text, continuing the prompt;
    token_ids: the generated tokens; cumulative_logprob: sum of the sampled tokens' logprobs
    (None unless `logprobs` was asked for); logprobs: SampleLogprobs or None;
    finish_reason: "stop" | "length" | "abort" (None while running); stop_reason: the stop
    string or stop token id that ended it, None for EOS, length or abort.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput(dict):
    """The outputs of one prompt (vLLM's RequestOutput), also a dict in nano-vllm's form.

    request_id: str, unique within the LLM; prompt: the prompt text (None for token-id prompts);
    prompt_token_ids; prompt_logprobs: PromptLogprobs or None; outputs: the n completions in
    sample order; finished: every completion has ended; num_cached_tokens: prompt tokens served
    by the prefix cache when the request was first scheduled; metrics: its times (vLLM's
    RequestMetrics) when the LLM keeps statistics (disable_log_stats=False), else None.

    As a dict (`out["text"]`, `out["token_ids"]`, `out["finish_reason"]`, `out["stop_reason"]`)
    it reads the first completion; `out["prompt_token_ids"]` the prompt's tokens.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 prompt_logprobs: PromptLogprobs | None, outputs: list[CompletionOutput], finished: bool,
                 num_cached_tokens: int | None = None, metrics=None):
        super().__init__(_dict_form(outputs, prompt_token_ids))
        self.metrics = metrics  # nanovllm.metrics.RequestMetrics with disable_log_stats=False, else None
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.outputs = outputs
        self.finished = finished
        self.num_cached_tokens = num_cached_tokens

    def __eq__(self, other):
        if isinstance(other, RequestOutput):
            return type(self) is type(other) and vars(self) == vars(other)
        return dict.__eq__(self, other)  # against a plain dict: nano-vllm's form

    def __ne__(self, other):
        return not self == other

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(request_id={self.request_id!r}, prompt={self.prompt!r}, "
                f"prompt_token_ids={self.prompt_token_ids}, prompt_logprobs={self.prompt_logprobs}, "
                f"outputs={self.outputs}, finished={self.finished}, num_cached_tokens={self.num_cached_tokens})")

    def __reduce__(self):
        return (_rebuild, (type(self), vars(self).copy()))


def _dict_form(outputs: list[CompletionOutput], prompt_token_ids: list[int]) -> dict:
    """nano-vllm's dict: the first completion's text, tokens and reasons, and the prompt."""
    first = outputs[0] if outputs else CompletionOutput(0, "", [])
    return {"text": first.text, "token_ids": first.token_ids, "finish_reason": first.finish_reason,
            "stop_reason": first.stop_reason, "prompt_token_ids": prompt_token_ids}


def _rebuild(cls, state):
    obj = cls.__new__(cls)
    dict.update(obj, _dict_form(state["outputs"], state["prompt_token_ids"]))
    obj.__dict__.update(state)
    return obj


__all__ = ["CompletionOutput", "Logprob", "PromptLogprobs", "RequestOutput", "SampleLogprobs", "StreamOutput"]
