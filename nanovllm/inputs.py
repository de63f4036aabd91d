"""vLLM's prompt types (`vllm.inputs`): the dicts `generate` takes besides plain text and token ids,
and how LLM reads one (loaded, through wiring/, by the first prompt dict)."""

from __future__ import annotations

from typing import TypedDict, Union

from nanovllm.limits import clip_repr

# Keys of vLLM's prompt dicts (TextPrompt / TokensPrompt) for inputs nano-vllm has no use for.
_UNSUPPORTED_PROMPT_KEYS = frozenset({"multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids",
                                      "cache_salt", "token_type_ids", "prompt_embeds"})


class TextPrompt(TypedDict, total=False):
    """A prompt given as text, tokenized by the engine."""

    prompt: str


class TokensPrompt(TypedDict, total=False):
    """A prompt given as token ids (not tokenized again)."""

    prompt_token_ids: list[int]


PromptType = Union[str, list[int], TextPrompt, TokensPrompt]


def dict_prompt(llm, prompt: dict) -> tuple[list[int], str | None]:
    """(token ids, text or None) of a prompt dict: {"prompt": text} (TextPrompt) or
    {"prompt_token_ids": ids} (TokensPrompt), tokenized (or checked) by `llm`."""
    unsupported = sorted(_UNSUPPORTED_PROMPT_KEYS & prompt.keys())
    if unsupported:
        raise NotImplementedError(f"prompt keys {unsupported} are not supported by nano-vllm (text models only)")
    unknown = sorted(prompt.keys() - {"prompt", "prompt_token_ids"})
    if unknown:
        raise TypeError(f"unknown prompt keys {clip_repr(unknown)}: a prompt dict has 'prompt' (text) or "
                        f"'prompt_token_ids' (token ids)")
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise TypeError(f"'prompt' must be a str, got {type(text).__name__}")
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if isinstance(ids, str) or not isinstance(ids, (list, tuple)):
            raise TypeError(f"'prompt_token_ids' must be a list of token ids, got {type(ids).__name__}")
        return llm.tokenize(list(ids)), text
    if text is None:
        raise TypeError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids' (token ids)")
    return llm.tokenize(text), text
