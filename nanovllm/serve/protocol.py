"""OpenAI's API as nano-vllm serves it: request bodies (validated by pydantic), their mapping onto
`SamplingParams`, and the JSON of responses, stream chunks, logprobs, usage and errors.

Request bodies take OpenAI's fields plus vLLM's extra sampling fields (what the official client
sends through `extra_body`: top_k, min_p, repetition_penalty, min_tokens, ignore_eos, ...).
Fields of the wrong type and unknown fields are refused (HTTP 400 naming them), never dropped.
No HTTP here: app.py and the route modules are the server.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from nanovllm.outputs import Logprob
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: usage in every chunk


class _Sampling(_Body):
    """The fields both endpoints share. None means "the default": the model's generation
    defaults (generation_config.json) for temperature, top_p, top_k, min_p and
    repetition_penalty, as vLLM does; SamplingParams' defaults otherwise."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, unused
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's: each choice also carries its token ids (and the prompt's), stream chunks their new ones
    return_token_ids: bool | None = False
    # vLLM's: the logprob of every prompt token after the first, and this many top ones beside it
    prompt_logprobs: int | None = None
    # Constraints on the output (features/structured/): OpenAI's response_format, vLLM's
    # structured_outputs (StructuredOutputsParams' fields) and the guided_* names it had before
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted: xgrammar serves every constraint
    guided_whitespace_pattern: str | None = None

    def sampling_params(self, defaults: dict, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The SamplingParams this request asks for (ValueError / TypeError as SamplingParams
        raises them). `max_tokens` None: a placeholder of 1, replaced once the prompt's length
        is known (EngineRequest.fill_max_tokens). `prompt_logprobs`: the prompt's, if more than
        the request's own field asks."""
        kw = dict(defaults)
        if self.prompt_logprobs is not None or prompt_logprobs is not None:
            kw["prompt_logprobs"] = max(self.prompt_logprobs or 0, prompt_logprobs or 0)
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported with stream=true")
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "stop", "seed", "logit_bias", "min_tokens", "ignore_eos", "stop_token_ids",
                     "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                     "allowed_token_ids", "bad_words"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        return SamplingParams(n=self.n, max_tokens=1 if max_tokens is None else max_tokens, logprobs=logprobs,
                              structured_outputs=self.constraint(), **kw)

    def constraint(self) -> StructuredOutputsParams | None:
        """The one output constraint the request gives, in any of its three forms, or None."""
        given = {}
        if self.structured_outputs is not None:
            given["structured_outputs"] = StructuredOutputsParams(**self.structured_outputs)
        legacy = {k: getattr(self, f"guided_{k}") for k in ("json", "regex", "choice", "grammar")
                  if getattr(self, f"guided_{k}") is not None}
        if legacy:
            given["guided_" + "/".join(legacy)] = StructuredOutputsParams(**legacy)
        rf = self.response_format
        if rf is not None and rf.get("type") != "text":
            given["response_format"] = _response_format(rf)
        if len(given) > 1:
            raise ValueError(f"give one output constraint, not {' and '.join(given)}")
        so = next(iter(given.values()), None)
        if so is not None and (self.guided_whitespace_pattern or so.whitespace_pattern):
            raise ValueError("whitespace_pattern is not supported (xgrammar): use disable_any_whitespace")
        return so

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def _response_format(rf: dict) -> StructuredOutputsParams:
    """OpenAI's {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema",
    "strict"}} as a constraint."""
    if rf.get("type") == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.get("type") == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
        return StructuredOutputsParams(json=spec["schema"])
    raise ValueError(f"response_format type {rf.get('type')!r} is not one of 'text', 'json_object', 'json_schema'")


class CompletionRequest(_Sampling):
    """POST /v1/completions. `logprobs` (0..max_logprobs): the legacy format's top tokens; with
    `echo`, the prompt's tokens too (the first one with no logprob), as evaluation harnesses
    score a text; `max_tokens=0` with `echo`: the prompt only, nothing generated."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not supported (only best_of == n)")
        if self.echo and self.logprobs is not None and self.stream:
            raise ValueError("echo together with logprobs is not supported with stream=true")
        if self.max_tokens is None or (self.max_tokens == 0 and not self.echo):
            raise ValueError("max_tokens must be an integer >= 1 (0 only with echo: the prompt alone)")
        if self.max_tokens == 0 and self.stream:
            raise ValueError("max_tokens=0 is not supported with stream=true")

    @property
    def generates(self) -> bool:
        """False for echo with max_tokens=0: the engine makes one token, which is not returned."""
        return self.max_tokens != 0

    @property
    def echo_logprobs(self) -> int | None:
        """The prompt logprobs echo with logprobs needs (the legacy format's top-k), or None."""
        return self.logprobs if self.echo and self.logprobs is not None else None

    def prompts(self) -> list:
        """The prompts: one text or token-id list each."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        return list(p)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def as_template_message(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)  # (vLLM's string format, as LLM.chat)
        role = "system" if self.role == "developer" else self.role  # OpenAI's newer name for it
        out = {"role": role, "content": content}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions. `logprobs` (bool) with `top_logprobs` (0..20) most likely
    tokens; `chat_template_kwargs` (vLLM's) go to the template (e.g. enable_thinking)."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's: a template of the request's own (only a trusting server takes it)

    def check(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if not self.messages:
            raise ValueError("messages must not be empty")

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's): the token ids of `prompt` (text, or token ids to check), or of
    `messages` rendered through the chat template as a chat request would be."""

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        if (self.chat_template_kwargs is not None or self.chat_template is not None) and self.messages is None:
            raise ValueError("chat_template_kwargs and chat_template go with messages")


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's): the text of `tokens`."""

    model: str | None = None
    tokens: list[int]


class LoadLoraAdapterRequest(_Body):
    """POST /v1/load_lora_adapter (vLLM's): serve the PEFT adapter in `lora_path` as `lora_name`."""

    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(_Body):
    """POST /v1/unload_lora_adapter (vLLM's): stop serving `lora_name`."""

    lora_name: str
    lora_int_id: int | None = None


# ---------------------------------------------------------------------------- responses
def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _top(entry: dict[int, Logprob], k: int) -> list[Logprob]:
    """The k most likely tokens of one position's {token id: Logprob} (the sampled token comes
    first in it, whatever its rank)."""
    return sorted(entry.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 62)[:k]


class LegacyLogprobs:
    """The completions endpoint's logprobs ({tokens, token_logprobs, top_logprobs,
    text_offset}), built up as tokens arrive; `offset` is where the text starts."""

    def __init__(self, k: int, offset: int = 0):
        self.k, self.offset = k, offset
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []

    def add(self, entries: list[dict[int, Logprob] | None], first_text: str = "") -> dict:
        """Append these positions; returns the JSON of just them (a stream chunk's). A None entry
        (a prompt's first token: nothing before it to score) is `first_text` with no logprob."""
        start = len(self.tokens)
        for entry in entries:
            if entry is None:
                self.tokens.append(first_text)
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                self.text_offset.append(self.offset)
                self.offset += len(first_text)
                continue
            chosen = next(iter(entry.values()))
            text = chosen.decoded_token or ""
            self.tokens.append(text)
            self.token_logprobs.append(chosen.logprob)
            self.top_logprobs.append({(lp.decoded_token or ""): lp.logprob for lp in _top(entry, self.k)}
                                     if self.k else {})
            self.text_offset.append(self.offset)
            self.offset += len(text)
        return self.json(start)

    def json(self, start: int = 0) -> dict:
        return {"tokens": self.tokens[start:], "token_logprobs": self.token_logprobs[start:],
                "top_logprobs": self.top_logprobs[start:], "text_offset": self.text_offset[start:]}


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None] | None, k: int) -> list | None:
    """vLLM's `prompt_logprobs` of a response: per prompt position None (the first) or
    {token id: {logprob, rank, decoded_token}} of the prompt's token and the k most likely (the
    engine may have made more, for echo's legacy logprobs)."""
    if entries is None:
        return None

    def position(entry):
        chosen = next(iter(entry.items()))
        kept = dict([chosen, *((lp_id, lp) for lp_id, lp in entry.items() if lp.rank is not None and lp.rank <= k)])
        return {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                for t, lp in kept.items()}

    return [None if e is None else position(e) for e in entries]


def _token_json(lp: Logprob) -> dict:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list[dict[int, Logprob]], k: int) -> list[dict]:
    """The chat endpoint's logprobs content items of these positions."""
    out = []
    for entry in entries:
        item = _token_json(next(iter(entry.values())))
        item["top_logprobs"] = [_token_json(lp) for lp in _top(entry, k)] if k else []
        out.append(item)
    return out
