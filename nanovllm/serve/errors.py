"""The server's errors: what a client gets (OpenAI's error JSON with an HTTP status), and the
helpers that keep an error's text short and able to cross a process pipe."""

from __future__ import annotations

import pickle

# The most characters of an error message a client gets: a message quoting a request's input
# (a million stop strings, 10^5 bad token ids) is cut there.
MAX_MESSAGE_CHARS = 1000


def capped(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text`, or its beginning and end (where a message names what is wrong) with the middle
    cut, `limit` characters in all and a note of how many were cut."""
    if len(text) <= limit:
        return text
    head, tail = limit * 2 // 3, limit // 3
    return f"{text[:head]} ... [{len(text) - head - tail} characters cut] ... {text[-tail:]}"


class APIError(Exception):
    """An error the client gets as OpenAI's JSON with this HTTP status (the message capped)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None):
        message = capped(message)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


class ClientGone(Exception):
    """The client of a request disconnected."""


def bad_request(e: BaseException) -> APIError:
    return APIError(400, str(e) or type(e).__name__)


def picklable(e: BaseException) -> BaseException:
    """`e`, or a RuntimeError with its text when it would not survive a process pipe."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}")
