"""Server-sent events in OpenAI's stream format: one `data: {chunk}` event per write, the chunk's
head (id, object, created, model) encoded once per stream."""

from __future__ import annotations

import json

from nanovllm.serve.errors import APIError
from nanovllm.serve.protocol import error_body, usage


def sse(data) -> str:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


class Chunks:
    """The server-sent events of one stream: OpenAI's chunk objects (the head's fields, one
    choice, the usage when asked), the head encoded once (a chunk is written for every token of
    every stream, so its JSON is on the server's hottest path)."""

    def __init__(self, head: dict, body, prompt_tokens: int):
        self.head, self.prompt_tokens, self.continuous = head, prompt_tokens, body.continuous_usage
        self._prefix = "data: " + json.dumps(head)[:-1] + ', "choices": ['  # (json.dumps of a dict ends in "}")
        self._suffix = '], "usage": null}\n\n' if body.include_usage else "]}\n\n"

    def choice(self, choice: dict, tokens: int) -> str:
        """A chunk of one choice; `tokens`: the completion tokens so far (continuous usage)."""
        if self.continuous:
            return sse({**self.head, "choices": [choice], "usage": usage(self.prompt_tokens, tokens)})
        return self._prefix + json.dumps(choice) + self._suffix

    def usage(self, tokens: int) -> str:
        """The last chunk of a stream that asked for usage: no choices."""
        return sse({**self.head, "choices": [], "usage": usage(self.prompt_tokens, tokens)})


async def sse_body(events, run):
    """A stream's body: its chunks (`events`), an APIError raised meanwhile as an error event,
    then `data: [DONE]`; the run is closed in any case, which aborts what is left of it (a client
    that left, an error, or a stream closed at its first chunk, before its batches began)."""
    try:
        async for part in events:
            yield part
    except APIError as e:
        yield sse(error_body(e.message, e.type, e.param, e.code))
    finally:
        run.close()
    yield sse("[DONE]")
