"""How errors quote what a request carried: enough to find the culprit, never a whole large input
(what one request may carry: features/sampling_checks.py)."""

from __future__ import annotations

import re

QUOTES = None  # filled by nanovllm.wiring: loads quotes.py (clip_repr's and describe_ids' bodies) at first use


def clip_repr(value, items: int = 5, chars: int = 80) -> str:
    """repr(value) for an error message, never a whole large input: a long string, or a
    container of more than `items` entries, shows its start and its size."""
    return QUOTES().clip_repr(value, items, chars)


def describe_ids(ids, limit: int = 5) -> str:
    """Token ids for an error message: all of a few, else the first `limit` and how many more."""
    return QUOTES().describe_ids(ids, limit)


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def check_unicode(text: str, what: str) -> None:
    """A ValueError naming `what` if `text` holds a lone surrogate: not valid Unicode, so no
    tokenizer can encode it (and the library's own message would not say why)."""
    lone = _LONE_SURROGATE.search(text)
    if lone is not None:
        raise ValueError(f"{what} holds a lone surrogate (U+{ord(lone.group()):04X}) at character {lone.start()}: "
                         "not valid Unicode text")
