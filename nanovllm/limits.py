"""How errors quote what a request carried: enough to find the culprit, never a whole large input
(what one request may carry: features/sampling_checks.py)."""

from __future__ import annotations

import itertools
import re


def clip_repr(value, items: int = 5, chars: int = 80) -> str:
    """repr(value) for an error message, never a whole large input: a long string, or a
    container of more than `items` entries, shows its start and its size."""
    if isinstance(value, str):
        return repr(value) if len(value) <= chars else f"{value[:chars]!r}... ({len(value)} characters)"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        if isinstance(value, dict):
            parts = [f"{clip_repr(k)}: {clip_repr(v)}" for k, v in itertools.islice(value.items(), items)]
        else:
            parts = [clip_repr(x) for x in itertools.islice(value, items)]
        if len(value) > items:
            parts.append(f"... ({len(value)} entries)")
        brackets = "[]" if isinstance(value, list) else "()" if isinstance(value, tuple) else "{}"
        return f"{brackets[0]}{', '.join(parts)}{brackets[1]}"
    text = repr(value)
    return text if len(text) <= 2 * chars else f"{text[:2 * chars]}... ({len(text)} characters)"


def describe_ids(ids, limit: int = 5) -> str:
    """Token ids for an error message: all of a few, else the first `limit` and how many more."""
    ids = list(ids)
    return f"{ids}" if len(ids) <= limit else f"{ids[:limit]} and {len(ids) - limit} more"


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def check_unicode(text: str, what: str) -> None:
    """A ValueError naming `what` if `text` holds a lone surrogate: not valid Unicode, so no
    tokenizer can encode it (and the library's own message would not say why)."""
    lone = _LONE_SURROGATE.search(text)
    if lone is not None:
        raise ValueError(f"{what} holds a lone surrogate (U+{ord(lone.group()):04X}) at character {lone.start()}: "
                         "not valid Unicode text")
