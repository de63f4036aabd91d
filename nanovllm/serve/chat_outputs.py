"""A chat choice's text as OpenAI's message: reasoning split into `reasoning_content` (the
server's --reasoning-parser) and tool calls read out (`tools` with tool_choice "auto", by the
--tool-call-parser) or spelled by a constrained output ("required", a named function).

`ChatTools.of` checks a request's tools and choice and says what its output must follow;
`ChoiceText` follows one choice's text as it streams: reasoning goes out as it comes, the answer
too up to where a tool call may begin ("auto"); from there it is held and parsed at the end (a
constrained call's text, "required" or a named function, is held whole).
"""

from __future__ import annotations

from dataclasses import dataclass

from nanovllm.features.reasoning import ReasoningSplitter, split_reasoning
from nanovllm.features.tools.choice import ToolCall, constraint, forced_calls, functions, mode_of
from nanovllm.features.tools.parsers import parse_tool_calls, splitter


@dataclass(frozen=True)
class ChatTools:
    """A request's tool use: mode ("none", "auto", "required" or a function's name), the tool
    call parser for "auto", and the reasoning parser (None: off)."""

    mode: str
    parser: str
    reasoning: str | None

    @classmethod
    def of(cls, body, given, tool_parser: str, reasoning: str | None) -> "ChatTools":
        """ValueError for tools or a tool choice that cannot run (`given`: the request's own
        constraint, body.constraint())."""
        if body.tools is not None:
            functions(body.tools)  # (checked: a ValueError naming the bad definition)
        mode = mode_of(body.tool_choice, body.tools)
        if mode not in ("none", "auto") and given is not None:
            raise ValueError(f"tool_choice {body.tool_choice!r} constrains the output itself: it cannot go with "
                             f"response_format or structured_outputs")
        return cls(mode, tool_parser, reasoning)

    def constraint(self, body, given):
        """What the output follows: the tool choice's constraint, else the request's own (`given`)."""
        so = constraint(self.mode, body.tools, body.parallel_tool_calls is not False) or given
        if so is not None and self.reasoning:
            so._reasoning_end = "</think>"  # the answer after the reasoning is what is constrained
        return so

    def calls(self, content: str | None) -> tuple[str | None, list[ToolCall]]:
        if self.mode == "none" or not content:
            return content, []
        if self.mode == "auto":
            return parse_tool_calls(content, self.parser)
        calls = forced_calls(self.mode, content)
        return (None, calls) if calls else (content, [])


class ChoiceText:
    """One choice's message, from its text pieces."""

    def __init__(self, tools: ChatTools):
        self.tools = tools
        self.splitter = ReasoningSplitter() if tools.reasoning else None
        self.calls = splitter(tools.parser) if tools.mode == "auto" else None  # content streams up to a call
        self.held: list[str] = []  # a constrained call's text ("required", a named function)
        self.streamed = False
        self.num_calls = 0

    def message(self, text: str) -> dict:
        """The whole message (a response's choice)."""
        reasoning, content = split_reasoning(text) if self.splitter else (None, text)
        content, calls = self.tools.calls(content)
        self.num_calls = len(calls)
        msg = {"role": "assistant", "content": content if content is not None or calls else ""}
        if self.splitter:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = [c.json() for c in calls]
        return msg

    def delta(self, text: str) -> dict:
        """The delta to send for this piece ({} when nothing can go yet)."""
        reasoning, content = self.splitter.feed(text) if self.splitter else ("", text)
        return self._delta(reasoning, content)

    def _delta(self, reasoning: str, content: str) -> dict:
        out = {"reasoning_content": reasoning} if reasoning else {}
        if self.calls is not None:
            content = self.calls.feed(content)
        elif self.tools.mode != "none":
            self.held.append(content)
            content = ""
        if content:
            out["content"] = content
            self.streamed = True
        return out

    def last_delta(self) -> dict:
        """What is left to send once the output is complete: held text, tool calls."""
        out = self._delta(*self.splitter.finish()) if self.splitter else {}
        calls = []
        if self.calls is not None:
            tail, calls = self.calls.finish(self.streamed)
        elif self.tools.mode != "none":
            tail, calls = self.tools.calls("".join(self.held))
        else:
            tail = ""
        if tail:
            out["content"] = out.get("content", "") + tail
        self.num_calls = len(calls)
        if calls:
            out["tool_calls"] = [c.json(i) for i, c in enumerate(calls)]
        return out

    def finish_reason(self, reason: str) -> str:
        """"tool_calls" when the model called tools on its own or had to ("required")."""
        return "tool_calls" if self.num_calls and self.tools.mode in ("auto", "required") else reason
