"""limits.py's clip_repr and describe_ids, loaded by the first error message that quotes a value."""

from __future__ import annotations

import itertools


def clip_repr(value, items: int = 5, chars: int = 80) -> str:
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
    ids = list(ids)
    return f"{ids}" if len(ids) <= limit else f"{ids[:limit]} and {len(ids) - limit} more"
