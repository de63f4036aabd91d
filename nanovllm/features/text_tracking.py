"""Text tracking (streamed text and stop strings), a feature on the core's TextTracker hook
(core/hooks.py): the lifecycle makes one per request that streams or has stop strings, once the
front wired this module in (wiring.enable_text_tracking).

Decoding the whole output again after every token costs O(n) per token. Instead, like vLLM
and HF's TextStreamer, each step decodes only a short window: the tokens that produced the
previous piece of text (as context, so decoders that treat a word's first token specially
still see it) plus the new tokens, and keeps the part of the text past the context.
"""

from __future__ import annotations

from collections.abc import Sequence

from nanovllm.core.detokenizer import REPLACEMENT, decoder, prompt_context


def _failure(s: str) -> list[int]:
    """KMP's prefix function of `s`: entry i is the length of the longest proper prefix of
    s[:i + 1] that also ends it."""
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    """Finds stop strings in text that arrives piece by piece, with one KMP automaton per
    string: memory linear in the strings' lengths and time linear in the text (for each string,
    the automaton's state is the longest start of it that the text ends with)."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self._fail = [_failure(s) for s in stops]
        self._state = [0] * len(stops)

    def feed(self, text: str) -> tuple[int, str] | None:
        """Read the next piece of text; the earliest match that ends in it (the first listed
        wins on a tie), as (its start relative to the piece, negative when it begins in earlier
        text; the stop string), or None."""
        best = None
        for i, s in enumerate(self.stops):
            state, end = self._advance(s, self._fail[i], self._state[i], text)
            self._state[i] = state
            if end >= 0 and (best is None or end + 1 - len(s) < best[0]):
                best = (end + 1 - len(s), s)
        return best

    @staticmethod
    def _advance(s: str, fail: list[int], state: int, text: str) -> tuple[int, int]:
        """(the state after `text`, or at the first match; the index in `text` where that match
        ends, or -1)."""
        j, n = 0, len(text)
        while j < n:
            if state == 0:  # skip to the next place the string can start
                j = text.find(s[0], j)
                if j < 0:
                    return 0, -1
            else:
                while state and s[state] != text[j]:
                    state = fail[state - 1]
                if s[state] != text[j]:
                    j += 1
                    continue
            state += 1
            if state == len(s):
                return state, j
            j += 1
        return state, -1

    def partial(self) -> int:
        """Length of the longest end of the text read that starts some stop string."""
        return max(self._state, default=0)


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text as they arrive, and watches for
    stop strings.

    `text` only ever grows by stable text: while the newest tokens end in an incomplete
    multi-byte character (the decode ends with U+FFFD), the complete characters before it are
    appended (and searched for stop strings) and the rest is held back until a later token
    completes it or `finish()` flushes it. The text continues the prompt (the prompt's tail is
    decoded in front of the output, as in vLLM): without a stop string the final `text` equals
    `detokenize_continuation(tokenizer, prompt_token_ids, output_ids)`, which keeps a leading
    space that a decode of the output alone would drop (SentencePiece) or never write (a
    decoder that joins words with spaces). A stop string ends the request; `text` is cut right
    before its earliest occurrence (the first listed wins on a tie), or right after it with
    `include_stop`.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
        spaces_between_special_tokens: bool = True,
    ):
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        self.stop = stop
        self.include_stop = include_stop
        self._decode = decoder(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self._matcher = StopMatcher(stop) if stop else None

        context, context_text = prompt_context(self._decode, prompt_token_ids)
        # _window holds the context tokens [:_read] and the tokens not yet turned into
        # text [_read:]; _context_text caches the decode of the former (None = stale).
        self._window: list[int] = context
        self._read = len(context)
        self._context_text: str | None = context_text
        # Characters of the window's text already appended while it still ended inside a
        # character (see _new_text).
        self._held_done = 0

        # The text is kept in pieces so that appending costs O(1), not O(len(text)).
        self._pieces: list[str] = []
        self._len = 0
        self._emitted = 0  # characters already handed out by pop_delta
        self._stop_string: str | None = None
        self._finished = False

    @property
    def text(self) -> str:
        """The output text so far (final once `finished`)."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the request, or None."""
        return self._stop_string

    @property
    def stopped(self) -> bool:
        """Whether a stop string was found."""
        return self._stop_string is not None

    @property
    def finished(self) -> bool:
        """Whether the text is final (a stop string was found or `finish()` was called)."""
        return self._finished

    def add(self, token_ids: Sequence[int]) -> bool:
        """Append newly generated tokens; returns True if a stop string has been found.

        Tokens arriving after the request finished are ignored.
        """
        if self._finished:
            return self.stopped
        self._window.extend(token_ids)
        delta, complete = self._new_text(final=False)
        if complete:
            # Later tokens only need the ones just decoded as context.
            del self._window[: self._read]
            self._read = len(self._window)
            self._context_text = None
            self._held_done = 0
        return self._append(delta) if delta else False

    def finish(self) -> bool:
        """Flush text held back for an incomplete character (generation ended for another
        reason, e.g. EOS or max_tokens); returns True if a stop string turned up in it."""
        if not self._finished:
            self._finished = True
            delta, _ = self._new_text(final=True)
            if delta:
                self._append(delta)
        return self.stopped

    def pop_delta(self, finished: bool) -> str:
        """Text not handed out before that is safe to show now.

        While the request runs, a tail that could still grow into a stop string is kept back,
        so the concatenated deltas always equal the final `text`. With `finished` (which
        calls `finish()`) everything left is returned.
        """
        if finished:
            self.finish()
        # The end of the text that may yet grow into a stop string (never any sent text).
        hold = 0 if self._finished or self._matcher is None else min(self._matcher.partial(), self._len - self._emitted)
        n = self._len - hold - self._emitted
        if n <= 0:
            return ""
        # Collect only the pieces that reach back into the unsent text.
        unsent_len = self._len - self._emitted
        parts, got = [], 0
        for piece in reversed(self._pieces):
            if got >= unsent_len:
                break
            parts.append(piece)
            got += len(piece)
        unsent = "".join(reversed(parts))[got - unsent_len :]
        self._emitted += n
        return unsent[:n]

    def _new_text(self, final: bool) -> tuple[str, bool]:
        """(text of the tokens past the context not appended yet, whether those tokens are now
        all text). While the decode ends inside a character (U+FFFD), only the complete
        characters before it are new text, so a stop string there is found at once; the
        tokens stay in the window until a later token completes the character."""
        if self._read == len(self._window):
            return "", False
        if self._context_text is None:
            self._context_text = self._decode(self._window[: self._read])
        full = self._decode(self._window)
        # No growth: skipped special tokens, or a decoder that waits for more tokens.
        if len(full) <= len(self._context_text):
            return "", False
        text = full[len(self._context_text):]
        if text.endswith(REPLACEMENT) and not final:
            stable = text.rstrip(REPLACEMENT)
            delta = stable[self._held_done:]
            self._held_done = max(self._held_done, len(stable))
            return delta, False
        return text[self._held_done:], True

    def _append(self, delta: str) -> bool:
        """Add stable text and look for a stop string ending in it."""
        start = self._len
        self._pieces.append(delta)
        self._len += len(delta)
        match = self._matcher.feed(delta) if self._matcher is not None else None
        if match is None:
            return False
        cut = start + match[0] + (len(match[1]) if self.include_stop else 0)
        self._pieces[:] = [self.text[:cut]]
        self._len = cut
        self._stop_string = match[1]
        self._finished = True
        return True


def track_text(tokenizer, prompt_token_ids: Sequence[int], params) -> IncrementalDetokenizer:
    """The TextTracker factory (core/hooks.py) for a request with these SamplingParams."""
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, params.stop_strings, params.skip_special_tokens,
                                  include_stop=params.include_stop_str_in_output,
                                  spaces_between_special_tokens=params.spaces_between_special_tokens)
