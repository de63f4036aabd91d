"""Each step's next tokens: sampled on the device, kept there for the next step, and sent to the
host in the background (overlap scheduling). `TokenSampler` (one per rank) owns the device buffer
the next step takes its unseen input tokens from, and the pinned host copies (`PendingTokens`)."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch

from nanovllm.core.sampler import Sampler, SamplingTensors
from nanovllm.core.sequence import Sequence
from nanovllm.model.attention import host_to_device

if TYPE_CHECKING:
    from nanovllm.core.hooks import LogitsProcessing, PendingLogprobs, StepLogprobs


def suppressed_tokens(seq: Sequence, eos_token_ids: frozenset[int]) -> set[int]:
    """Tokens `seq` may not sample before min_tokens: its stop ids and, unless it ignores EOS, EOS's."""
    if seq.num_completion_tokens >= seq.params.min_tokens:
        return set()
    return set(seq.params.stop_ids) | (set() if seq.params.ignore_eos else set(eos_token_ids))


class PendingTokens:
    """Sampled tokens on their way to the host; `result()` waits for them (and only for them).
    check (tensor parallelism): raises once a peer died; the wait then polls the event and calls
    it meanwhile and after, since a dead peer's collectives may never finish, or finish (aborted)
    with garbage. `logprobs()`: the step's StepLogprobs (after result()), or None."""

    def __init__(self, host: torch.Tensor, n: int, event, check=None, logprobs: PendingLogprobs | None = None):
        self._host, self._n, self._event, self._check = host, n, event, check
        self._logprobs = logprobs

    def result(self) -> list[int]:
        if self._event is not None:
            if self._check is None:
                self._event.synchronize()
            else:
                while not self._event.query():
                    self._check()
                    time.sleep(0)  # lets the watchdog thread run
        if self._check is not None:
            self._check()
        return self._host[:self._n].tolist()

    def logprobs(self) -> StepLogprobs | None:
        return None if self._logprobs is None else self._logprobs.result()


class TokenSampler:
    """Samples the next token of each row on one rank and hands the tokens to the host.
    `processing` (core/hooks.py's LogitsProcessing), installed by the fronts at the first request
    that asks for a logits extension or logprobs, runs them; until then the basic sampler alone."""

    def __init__(self, max_rows: int, device: torch.device, tp, sampler: Sampler | None = None):
        self.device, self.tp = device, tp
        self.pin = device.type == "cuda"
        self.sampler = Sampler() if sampler is None else sampler  # a CUDA engine's: TritonSampler
        self.processing: LogitsProcessing | None = None
        # The last step's sampled tokens, a row per scheduled sequence, for the next step's inputs;
        # two pinned host copies alternate so that reading step n's never races with step n+1's.
        self.prev_tokens = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self._host = [torch.zeros(max_rows, dtype=torch.int32, pin_memory=self.pin) for _ in range(2)]
        self._events = [torch.cuda.Event() if self.pin else None for _ in range(2)]
        self._flip = 0
        self._last: PendingTokens | None = None  # the last published step's tokens
        self._cache = None  # (key, SamplingTensors, extension states | None) of the last step

    def input_tokens(self, ids: torch.Tensor, src_rows: torch.Tensor) -> torch.Tensor:
        """Input token per row: the host's, or (src >= 0) the previous step's sampled token that
        is still on the device. Part of the captured decode graph, so it costs no launches."""
        return torch.where(src_rows >= 0, self.prev_tokens.index_select(0, src_rows.clamp(min=0)), ids)

    def share_previous(self) -> None:
        """Only rank 0 sampled the previous step: hand its tokens to every rank, on the device."""
        self.tp.broadcast_from_rank0(self.prev_tokens)

    def release(self, seq: Sequence) -> None:
        """`seq` ended: the extensions drop its state."""
        if self.processing is not None:
            self.processing.release(seq)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: list[Sequence], eos_token_ids: frozenset[int],
               check=None, step=None, defer: bool = False) -> PendingTokens:
        """The next token of each row (rank 0) from logits [len(rows) (+ prompt-logprob rows: `step`'s), V],
        left in `prev_tokens` and copied to the host without blocking. `defer` (the runner flushes
        before the next step reads them): the processing's background host work may hold the draw."""
        self.flush()
        n = len(rows)
        offsets = step.sample_offsets if step is not None and step.sample_offsets else [len(s) for s in rows]
        processing = self.processing
        if step is not None and step.prompt_rows and (processing is None or processing.logprobs is None):
            raise RuntimeError("prompt logprobs were planned but no logprobs extension is registered")
        if processing is not None:
            return processing.sample(logits, rows, offsets, self._suppress(rows, eos_token_ids), check, step, defer)
        t, _ = self.cached_tensors([s.seq_id for s in rows], offsets, lambda: (self.tensors(rows, offsets), None))
        self.prev_tokens[:n].copy_(self.sampler(logits[:n], t, self._suppress(rows, eos_token_ids)))
        return self.publish(n, check)

    def flush(self) -> None:
        """Queue a draw the processing deferred (before the next step reads prev_tokens)."""
        if self.processing is not None:
            self.processing.flush()

    def tensors(self, rows: list[Sequence], offsets: list[int]) -> SamplingTensors:
        """The rows' sampling parameters on the device (`offsets`: each row's noise offset)."""
        return SamplingTensors.build([s.params for s in rows], [s.seed for s in rows], offsets, self.device,
                                     pin_memory=self.pin)

    def _suppress(self, rows: list[Sequence], eos_token_ids: frozenset[int]):
        """(rows, cols) device index tensors of the tokens suppressed before min_tokens, or None."""
        rws, cols = [], []
        for i, s in enumerate(rows):
            banned = suppressed_tokens(s, eos_token_ids)
            rws.extend([i] * len(banned))
            cols.extend(banned)
        if not rws:
            return None
        return (host_to_device(rws, torch.long, self.device, self.pin),
                host_to_device(cols, torch.long, self.device, self.pin))

    def publish(self, n: int, check=None, logprobs: PendingLogprobs | None = None) -> PendingTokens:
        """Start copying the step's sampled tokens (`prev_tokens[:n]`) to the host (`check`:
        see PendingTokens); `logprobs`' copies were queued before, so the same event covers them."""
        self._flip ^= 1
        host, event = self._host[self._flip], self._events[self._flip]
        host[:n].copy_(self.prev_tokens[:n], non_blocking=self.pin)
        if event is not None:
            event.record()
        self._last = PendingTokens(host, n, event, check, logprobs)
        return self._last

    def last_published(self) -> PendingTokens | None:
        """The last published step's PendingTokens (to wait for on another thread)."""
        return self._last

    def cached_tensors(self, key, offsets: list[int], build):
        """`build()` -> (SamplingTensors, extras), or the last step's with new offsets when `key`
        (what fixes the per-row parameters) is unchanged, as in consecutive decode steps."""
        cached = self._cache
        if cached is not None and cached[0] == key:
            t = dataclasses.replace(cached[1], offsets=host_to_device(offsets, torch.long, self.device, self.pin))
            extras = cached[2]
        else:
            t, extras = build()
        self._cache = (key, t, extras)
        return t, extras
