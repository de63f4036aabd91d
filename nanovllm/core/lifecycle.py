"""The request lifecycle: a request's text state, the step in flight, and the one rule that
decides when and why a request ends. Step n+1 is launched before step n's tokens reach the host,
so a request's last token is a placeholder for one step (Sequence.add_pending_token), and one that
reached its length is retired at launch but finishes when that token arrives. (Aborts, and the
requests of a step whose tokens will never be read: core/engine_extras.py.)"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from nanovllm.core.detokenizer import detokenize_continuation
from nanovllm.core.scheduler import ScheduledBatch, Scheduler
from nanovllm.core.sequence import Sequence

if TYPE_CHECKING:
    from nanovllm.core.hooks import DraftVerifier, TextTracker, TextTrackerFactory


@dataclass
class StepOutput:
    """What one step did for one request: the tokens and text it added, and whether it ended.
    `text`: the newly stable text (requests that track text: streaming or stop strings);
    `logprobs`: the new tokens' raw entries (Sequence.logprobs) when the request asks for them."""

    seq: Sequence
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    logprobs: list[tuple] | None = None


class StepResult(NamedTuple):
    """What `LLMEngine.step()` returns: the resolved step's outputs, tokens computed, and kind."""

    outputs: list[StepOutput]
    num_tokens: int
    is_prefill: bool


def is_stop_token(seq: Sequence, token_id: int, eos_token_ids: frozenset[int]) -> bool:
    """Whether `token_id`, just appended to `seq`, ends it (stop ids / EOS after min_tokens)."""
    p = seq.params
    if seq.num_completion_tokens < p.min_tokens:
        return False
    return token_id in p.stop_ids or (not p.ignore_eos and token_id in eos_token_ids)


def decide_finish(seq: Sequence, token_id: int, eos_token_ids: frozenset[int], max_model_len: int,
                  detok: TextTracker | None = None) -> tuple[str, int | str | None] | None:
    """Whether the token just filled in ends `seq`, and why: (finish_reason, stop_reason) or None.
    The only place a finish is decided (besides an abort). An ending request first flushes the
    text held back for an incomplete character: a stop string found there makes it "stop"."""
    stopped_by_text = detok is not None and detok.add([token_id])  # the text grows in any case
    if is_stop_token(seq, token_id, eos_token_ids):
        finish = ("stop", token_id if token_id in seq.params.stop_ids else None)
    elif stopped_by_text:
        return "stop", detok.stop_string
    elif seq.reached_length(max_model_len):
        finish = ("length", None)
    else:
        return None
    if detok is not None and detok.finish():  # a stop string in the text held back until now
        return "stop", detok.stop_string
    return finish


@dataclass
class InFlightStep:
    """A launched step whose sampled tokens have not reached the host yet; `shape`: its StepShape
    (core/step_timing.py), taken at launch while the engine's steps are observed."""

    batch: ScheduledBatch
    tokens: object  # PendingTokens (core/sampling.py)
    shape: tuple[int, int, int] | None = None

    def resolve(self, requests: RequestLifecycle) -> tuple[list[StepOutput], float]:
        """Wait for the tokens and account for them; (outputs, seconds waited)."""
        t = time.perf_counter()
        token_ids = self.tokens.result()
        waited = time.perf_counter() - t
        return requests.accept(self.batch, token_ids, self.tokens.logprobs()), waited


class RequestLifecycle:
    """What happens to requests between the scheduler and the caller: their text state (stop
    strings, streamed text), launched steps and their tokens, finishes and the final text."""

    def __init__(self, scheduler: Scheduler, tokenizer, eos_token_ids: frozenset[int], max_model_len: int,
                 release=None):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        # release(seq): the request ended; drop its per-request sampler state (penalty counts).
        self.release = release
        # Text tracking (streamed text, stop strings: engine_extras.track_text), per request.
        self._detok: dict[int, TextTracker] = {}
        self.track_text: TextTrackerFactory | None = None  # the front wires it in
        self._streamed: set[int] = set()  # requests whose text increments someone reads
        self.verifier: DraftVerifier | None = None  # keeps the tokens of rows that verified drafts

    def add(self, seq: Sequence) -> None:
        """Queue a validated request (its sample 0, whose `samples` are all of them)."""
        self.scheduler.add(seq)

    def launched(self, batch: ScheduledBatch) -> None:
        """A step was launched: hold its tokens' places, retire requests that reached their length."""
        self.scheduler.advance(batch, self.max_model_len)

    def accept(self, batch: ScheduledBatch, token_ids: list[int], logprobs=None) -> list[StepOutput]:
        """A launched step's tokens have arrived (`token_ids[i]` for `batch.rows[i]`): fill them in,
        decide finishes, build the outputs; `logprobs`: the step's StepLogprobs (core/hooks.py)."""
        outputs = []
        if logprobs is not None:
            logprobs.add_prompt_entries(batch)
        for i, (seq, token_id) in enumerate(zip(batch.rows, token_ids)):
            if seq.pending_row != i:
                continue  # partial prompt chunk, aborted, or a row verifying a draft
            detok, entries = self._detok.get(seq.seq_id), []
            if seq.drafts:  # its rows i.. sampled after each draft
                new = self.verifier.verify(seq, token_ids[i:i + 1 + len(seq.drafts)],
                                         lambda j, t: self._take(seq, t, logprobs, i + j, detok, entries))
            else:
                new = [token_id]
                seq.fill_pending_token(token_id)
                self._take(seq, token_id, logprobs, i, detok, entries)
            text = detok.pop_delta(finished=seq.is_finished) if seq.seq_id in self._streamed else ""
            outputs.append(StepOutput(seq, new, text, seq.is_finished, seq.finish_reason, entries or None))
        return outputs

    def _take(self, seq: Sequence, token_id: int, logprobs, row: int, detok, entries: list) -> bool:
        """Account for `seq`'s token just filled in, sampled in `row`: its logprob entry (kept in
        `entries` too) when the request asks for them, then the finish rule; whether it ended."""
        if seq.logprobs is not None:
            if logprobs is None or row not in logprobs.sample:
                raise RuntimeError(f"internal error: no logprobs for row {row} ({seq})")
            entries.append(logprobs.take(seq, row))
        finish = decide_finish(seq, token_id, self.eos_token_ids, self.max_model_len, detok)
        if finish is not None:
            self.end(seq, *finish)
        return finish is not None

    def end(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        self.scheduler.retire(seq)
        seq.finish(reason, stop_reason)
        if self.release is not None and seq.params.processes_logits:
            self.release(seq)

    def forget_text(self, seq: Sequence) -> None:
        """Drop a request's detokenizer state (its text will not be read)."""
        self._detok.pop(seq.seq_id, None)
        self._streamed.discard(seq.seq_id)

    def final_text(self, seq: Sequence) -> str:
        """The finished request's output text as it continues the prompt; forgets its detokenizer."""
        detok = self._detok.get(seq.seq_id)
        self.forget_text(seq)
        if detok is not None:
            return detok.text
        if self.tokenizer is None or not seq.params.detokenize:
            return ""
        p = seq.params
        return detokenize_continuation(self.tokenizer, seq.prompt_token_ids, seq.completion_token_ids,
                                       p.skip_special_tokens, p.spaces_between_special_tokens)
