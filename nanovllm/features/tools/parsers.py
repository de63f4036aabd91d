"""Tool calls read out of a model's free text (tool_choice "auto"), vLLM's `--tool-call-parser`:

- "hermes" (Qwen2.5 / Qwen3, Hermes): each call is `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`; the text outside the blocks (each piece stripped, joined by a space) is
  the message's content.
- "llama3_json" (Llama 3.x): the whole output is `{"name": ..., "parameters": {...}}` (maybe
  after `<|python_tag|>`), or several separated by ";".

Each parser is a splitter fed the text as it streams: what is surely content goes out at once,
and from where a call may begin the text is held and parsed at the end. The whole-text parse is
the same splitter fed once, so a stream adds up to the response. Text that does not parse as a
call stays content: a parser never loses the model's words.
"""

from __future__ import annotations

import json
import re

from nanovllm.features.tools.choice import ToolCall

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_OPEN = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def _call(text: str) -> ToolCall | None:
    try:
        value = json.loads(text, strict=False)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class HermesSplitter:
    """Content up to the first `<tool_call>` streams (its trailing whitespace and a possible
    partial tag held back); the rest is parsed at the end."""

    def __init__(self):
        self.started, self.held, self.calls_from = False, "", None  # calls_from: text from the first tag

    def feed(self, text: str) -> str:
        if self.calls_from is not None:
            self.calls_from += text
            return ""
        buf = self.held + text
        if not self.started:
            buf = buf.lstrip()
            self.started = bool(buf)
        at = buf.find(_OPEN)
        if at >= 0:
            self.calls_from, self.held = buf[at:], ""
            return buf[:at].rstrip()
        keep = next((n for n in range(len(_OPEN) - 1, 0, -1) if buf.endswith(_OPEN[:n])), 0)
        body = buf[:len(buf) - keep]
        out = body.rstrip()
        self.held = body[len(out):] + buf[len(buf) - keep:]
        return out

    def finish(self, streamed: bool) -> tuple[str, list[ToolCall]]:
        """(the content still to send, the calls); `streamed`: whether content went out already."""
        if self.calls_from is None:
            return ("" if not self.held.strip() else self.held), []
        calls, pieces, last = [], [], 0
        for m in _HERMES.finditer(self.calls_from):
            call = _call(m.group(1))
            if call is not None:
                calls.append(call)
                pieces.append(self.calls_from[last:m.start()])
                last = m.end()
        pieces.append(self.calls_from[last:])
        rest = " ".join(p.strip() for p in pieces if p.strip())
        return ((" " if streamed and rest else "") + rest), calls


class Llama3JsonSplitter:
    """An output that opens with `{` or `<|python_tag|>` is held whole and parsed at the end;
    any other streams as content."""

    def __init__(self):
        self.mode, self.held = None, ""  # None: not yet known; "text" or "calls"

    def feed(self, text: str) -> str:
        if self.mode == "text":
            return text
        self.held += text
        head = self.held.lstrip()
        if self.mode is None and head:
            if head.startswith("{") or head.startswith(_PYTHON_TAG):
                self.mode = "calls"
            elif not _PYTHON_TAG.startswith(head):
                self.mode, out, self.held = "text", self.held, ""
                return out
        return ""

    def finish(self, streamed: bool) -> tuple[str, list[ToolCall]]:
        calls = _json_calls(self.held.strip().removeprefix(_PYTHON_TAG)) if self.mode == "calls" else None
        return ("", calls) if calls else (self.held, [])


def _json_calls(body: str) -> list[ToolCall] | None:
    """Calls written one after another as JSON objects, separated by ";" (and whitespace); None
    unless the whole text is such calls (a ";" inside a string is the string's)."""
    decoder, calls, at = json.JSONDecoder(strict=False), [], 0
    while True:
        while at < len(body) and (body[at].isspace() or (body[at] == ";" and calls)):
            at += 1
        if at == len(body):
            return calls or None
        try:
            value, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return None
        call = _call(json.dumps(value)) if isinstance(value, dict) else None
        if call is None:
            return None
        calls.append(call)


PARSERS = {"hermes": HermesSplitter, "llama3_json": Llama3JsonSplitter}


def splitter(parser: str):
    """A new splitter of the named parser (ValueError naming an unknown one)."""
    if parser not in PARSERS:
        raise ValueError(f"tool call parser {parser!r} is not one of {sorted(PARSERS)}")
    return PARSERS[parser]()


def parse_tool_calls(text: str, parser: str = "hermes") -> tuple[str | None, list[ToolCall]]:
    """(the message's content, None when empty; the calls) of a model's whole text."""
    s = splitter(parser)
    head = s.feed(text)
    tail, calls = s.finish(bool(head))
    return (head + tail) or None, calls
