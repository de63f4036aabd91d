"""Tool calls read out of a model's free text (tool_choice "auto"), vLLM's `--tool-call-parser`:

- "hermes" (Qwen2.5 / Qwen3, Hermes): each call is `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`; the text around the blocks is the message's content.
- "llama3_json" (Llama 3.x): the whole output is `{"name": ..., "parameters": {...}}` (maybe
  after `<|python_tag|>`), or several separated by ";".

Text that does not parse as a call stays content: a parser never loses the model's words.
"""

from __future__ import annotations

import json
import re

from nanovllm.features.tools.choice import ToolCall

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _call(text: str, args_key: str) -> ToolCall | None:
    try:
        value = json.loads(text, strict=False)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get(args_key, value.get("arguments", value.get("parameters", {})))
    return ToolCall(value["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    calls, kept, last = [], [], 0
    for m in _HERMES.finditer(text):
        call = _call(m.group(1), "arguments")
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last:m.start()])
        last = m.end()
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


def llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    calls = [_call(part, "parameters") for part in body.split(";")] if body.startswith("{") else [None]
    if not calls or any(c is None for c in calls):
        return text, []
    return None, calls


PARSERS = {"hermes": hermes, "llama3_json": llama3_json}


def parse_tool_calls(text: str, parser: str = "hermes") -> tuple[str | None, list[ToolCall]]:
    """(the message's content, the calls) of a model's text, by the named parser."""
    if parser not in PARSERS:
        raise ValueError(f"tool call parser {parser!r} is not one of {sorted(PARSERS)}")
    return PARSERS[parser](text)
