"""What one request may carry: bounds on its stop strings, bad words, logit_bias, token-id lists
and prompt size, checked on the server before any work, with a 400 that names the field and the
bound (never the value itself). Text must be valid Unicode (no lone surrogates), which JSON
allows but no tokenizer takes.

The bounds keep one request's cost to the engine small: every stop string and bad word is
checked at every token, every logit_bias entry lands in the sampler's tensors.
"""

from __future__ import annotations

MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 1024
# A text prompt may have at most this many characters per token of the context (max_model_len):
# a longer one could never fit, and tokenizing it would only cost time.
MAX_PROMPT_CHARS_PER_TOKEN = 32


def check_text(where: str, text: str) -> None:
    """A ValueError if `text` is not valid Unicode (a lone surrogate, e.g. JSON's "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where} is not valid Unicode text: a lone surrogate U+{ord(text[e.start]):04X} at "
                         f"character {e.start}") from None


def _strings(where: str, values: list[str], most: int, longest: int, what: str) -> None:
    if len(values) > most:
        raise ValueError(f"{where}: at most {most} {what} per request, got {len(values)}")
    for i, s in enumerate(values):
        if len(s) > longest:
            raise ValueError(f"{where}[{i}]: a {what[:-1]} may have at most {longest} characters, got {len(s)}")
        check_text(f"{where}[{i}]", s)


def check_sampling(body) -> None:
    """The bounds of the sampling fields both endpoints share (protocol._Sampling)."""
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    _strings("stop", stop or [], MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS, "stop strings")
    _strings("bad_words", body.bad_words or [], MAX_BAD_WORDS, MAX_BAD_WORD_CHARS, "bad words")
    if body.logit_bias is not None and len(body.logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries per request, got {len(body.logit_bias)}")
    if body.stop_token_ids is not None and len(body.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} per request, got {len(body.stop_token_ids)}")


def check_prompt(where: str, prompt, max_model_len: int) -> None:
    """One prompt (text or token ids): no longer than the context can hold, valid text."""
    if isinstance(prompt, str):
        most = MAX_PROMPT_CHARS_PER_TOKEN * max_model_len
        if len(prompt) > most:
            raise ValueError(f"{where} of {len(prompt)} characters is too long: at most {most} "
                             f"({MAX_PROMPT_CHARS_PER_TOKEN} per token of max_model_len={max_model_len})")
        check_text(where, prompt)
    elif len(prompt) > max_model_len:
        raise ValueError(f"{where} of {len(prompt)} tokens is longer than max_model_len={max_model_len}")


def check_messages(messages: list[dict], max_model_len: int) -> None:
    """A conversation's texts: valid, and all together no longer than a prompt may be."""
    total = 0
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, str):
            check_text(f"messages[{i}].content", content)
            total += len(content)
    most = MAX_PROMPT_CHARS_PER_TOKEN * max_model_len
    if total > most:
        raise ValueError(f"messages of {total} characters are too long: at most {most} "
                         f"({MAX_PROMPT_CHARS_PER_TOKEN} per token of max_model_len={max_model_len})")
