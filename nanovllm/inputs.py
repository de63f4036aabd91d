"""vLLM's prompt types (`vllm.inputs`): the dicts `generate` takes besides plain text and token ids."""

from __future__ import annotations

from typing import TypedDict, Union


class TextPrompt(TypedDict, total=False):
    """A prompt given as text, tokenized by the engine."""

    prompt: str


class TokensPrompt(TypedDict, total=False):
    """A prompt given as token ids (not tokenized again)."""

    prompt_token_ids: list[int]


PromptType = Union[str, list[int], TextPrompt, TokensPrompt]
