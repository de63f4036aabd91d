"""Reasoning split from the answer (vLLM's `--reasoning-parser qwen3`): a Qwen3 output that opens
with `<think>` holds its reasoning up to `</think>`, then the answer. `reasoning_content` gets the
one, `content` the other; an output without `<think>` (thinking off) is all answer.
`ReasoningSplitter` does the same on a stream of text pieces, holding back only what could
still be the start of a tag."""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("qwen3",)


def split_reasoning(text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole output; None for an empty part."""
    s = ReasoningSplitter()
    reasoning, content = s.feed(text)
    r2, c2 = s.finish()
    return (reasoning + r2) or None, (content + c2) or None


class ReasoningSplitter:
    """States: start (not yet known), opening / after (newlines after a tag, dropped),
    reasoning, answer."""

    def __init__(self):
        self.state, self.held = "start", ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that can be sent for this piece."""
        buf, self.held = self.held + text, ""
        reasoning = ""
        if self.state == "start":
            stripped = buf.lstrip()
            if stripped.startswith(START):
                self.state, buf = "opening", stripped[len(START):]
            elif START.startswith(stripped):  # could still become the tag
                self.held = buf
                return "", ""
            else:
                self.state = "answer"
        buf = self._skip_newlines(buf, "opening", "reasoning")
        if self.state == "reasoning":
            at = buf.find(END)
            if at < 0:
                keep = next((n for n in range(len(END) - 1, 0, -1) if buf.endswith(END[:n])), 0)
                self.held = buf[len(buf) - keep:] if keep else ""
                return buf[:len(buf) - keep], ""
            reasoning, buf, self.state = buf[:at], buf[at + len(END):], "after"
        return reasoning, self._skip_newlines(buf, "after", "answer")

    def _skip_newlines(self, buf: str, state: str, then: str) -> str:
        if self.state == state:
            buf = buf.lstrip("\n")
            if buf:
                self.state = then
        return buf

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output is complete."""
        held, self.held = self.held, ""
        return (held, "") if self.state == "reasoning" else ("", held)
