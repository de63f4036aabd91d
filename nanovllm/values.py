"""What counts as an integer, a real number and a list of token ids in a request (numpy's
numbers included, bool not)."""

from __future__ import annotations

import numbers


def is_integer(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def as_token_ids(values) -> list[int] | None:
    """A list or tuple of integers as a new list of Python ints, or None if some element is not
    one. Plain ints are recognised in C (the set of the elements' types): long prompts."""
    if set(map(type, values)) <= {int}:
        return list(values)
    if all(is_integer(t) for t in values):
        return [int(t) for t in values]
    return None


def is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)
