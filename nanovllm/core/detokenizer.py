"""Token ids to text: a request's output as it continues its prompt, and the decoding helpers
that text tracking (features/text_tracking.py: streamed text, stop strings) builds on."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tokenizers

REPLACEMENT = "\ufffd"
# Prompt tokens decoded in front of the first output token. A few are enough for decoders
# whose output depends on what precedes a token (SentencePiece drops a leading space).
_PROMPT_CONTEXT = 5


def _fast_backend(tokenizer) -> tokenizers.Tokenizer | None:
    """The Rust tokenizer behind `tokenizer` if its class does not customise decoding (transformers'
    decode wraps the Rust call in Python that would dominate the per-token cost)."""
    if isinstance(tokenizer, tokenizers.Tokenizer):
        return tokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    cls = type(tokenizer)
    if isinstance(tokenizer, PreTrainedTokenizerFast) and getattr(cls, "decode", None) is PreTrainedTokenizerBase.decode \
            and getattr(cls, "_decode", None) is PreTrainedTokenizerFast._decode:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if isinstance(backend, tokenizers.Tokenizer):
            return backend
    return None


def decoder(tokenizer, skip_special_tokens: bool,
             spaces_between_special_tokens: bool = True) -> Callable[[list[int]], str]:
    backend = _fast_backend(tokenizer)
    if backend is not None:
        # Fast (Rust) tokenizers have no spaces_between_special_tokens option (nor does vLLM's
        # detokenizer for them): their decoder decides.
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    # The clean-up heuristic ("a ." -> "a.") depends on neighbouring tokens, so it cannot be
    # applied piecewise; it is off everywhere so that incremental and full decodes agree.
    extra = {} if spaces_between_special_tokens else {"spaces_between_special_tokens": False}
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                        clean_up_tokenization_spaces=False, **extra)


def prompt_context(decode: Callable[[list[int]], str], prompt_token_ids: Sequence[int]) -> tuple[list[int], str]:
    """The last few prompt tokens, decoded in front of the output so that it reads as a continuation
    (a decoder may join words with spaces, or drop a leading space at the start of a decode), and
    their text; none when the prompt ends inside a character: the output must not complete it."""
    context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
    context_text = decode(context) if context else ""
    if context_text.endswith(REPLACEMENT):
        return [], ""
    return context, context_text


def detokenize_continuation(tokenizer, prompt_token_ids: Sequence[int], output_ids: Sequence[int],
                            skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> str:
    """The text of `output_ids` as it continues the prompt (vLLM's: prompt text + this reads as the
    whole), in one decode: what text tracking ends up with, without a stop string."""
    decode = decoder(tokenizer, skip_special_tokens, spaces_between_special_tokens)
    context, context_text = prompt_context(decode, prompt_token_ids)
    return decode(context + list(output_ids))[len(context_text):]
