"""The logits extensions and the logprobs reader of rank 0's TokenSampler (core/sampling.py): what
its draw becomes once a request asks for penalties, logit_bias, bad words, allowed ids, a
structured output or logprobs. nanovllm/wiring/ installs it then (`logits_processing`); a
sampler without it draws from the raw logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nanovllm.core.sampling import PendingTokens, TokenSampler
from nanovllm.core.sequence import Sequence

if TYPE_CHECKING:
    from nanovllm.core.hooks import LogitsExtension, LogprobsExtension, StepLogprobs


def logits_processing(sampler: TokenSampler) -> LogitsProcessing:
    """`sampler`'s LogitsProcessing, installed at the first call."""
    if sampler.processing is None:
        sampler.processing = LogitsProcessing(sampler)
    return sampler.processing


def _suppress_unless_nothing_is_left(x: torch.Tensor, suppress) -> None:
    """min_tokens' suppression applied to the extensions' fp32 logits x, but not on a row where
    they allow nothing else (a structured output that is complete allows only EOS): the row may
    then take them. Without a host sync (the rows are found on the device)."""
    rows, cols = suppress
    banned = x.index_put((rows, cols), x.new_tensor(float("-inf")))
    nothing_left = torch.isneginf(banned).all(dim=-1)
    x.index_put_((rows, cols), torch.where(nothing_left[rows], x[rows, cols], float("-inf")))


class DeferredTokens:
    """PendingTokens whose draw waits for an extension's background host work (queued by
    TokenSampler.flush at the next launch, or by the first wait for the tokens)."""

    def __init__(self, draw):
        self._draw, self._pending = draw, None

    def queue(self) -> PendingTokens:
        self._pending = self._pending or self._draw()
        return self._pending

    def result(self) -> list[int]:
        return self.queue().result()

    def logprobs(self) -> StepLogprobs | None:
        return self.queue().logprobs()


class LogitsProcessing:
    """`extensions` change the logits of the rows they apply to, in their `order`, on an fp32
    copy; `logprobs` reads the raw logits after the draw. Registered at their first use
    (add_extension, set_logprobs); a step in which no row asks for any runs the basic sampler
    on the raw logits."""

    def __init__(self, sampler: TokenSampler):
        self.sampler = sampler
        self.extensions: list[LogitsExtension] = []
        self.logprobs: LogprobsExtension | None = None
        self._deferred: DeferredTokens | None = None  # a draw waiting for flush()

    def add_extension(self, ext: LogitsExtension) -> None:
        self.extensions = sorted(self.extensions + [ext], key=lambda e: e.order)

    def add_once(self, kind: type, make) -> None:
        """Register make() unless an extension of class `kind` is registered already."""
        if not any(isinstance(e, kind) for e in self.extensions):
            self.add_extension(make())

    def set_logprobs(self, ext: LogprobsExtension) -> None:
        self.logprobs = ext

    def release(self, seq: Sequence) -> None:
        for ext in self.extensions:
            ext.release(seq)

    def sample(self, logits: torch.Tensor, rows: list[Sequence], offsets: list[int], suppress, check, step,
               defer: bool) -> PendingTokens | DeferredTokens:
        """TokenSampler.sample's draw (`suppress`: its min_tokens index tensors, or None)."""
        n = len(rows)
        prompt_logits = logits[n:] if step is not None and step.prompt_rows else None
        logits = logits[:n]
        # Extensions are only added: their count, with the rows, says whether the states still hold.
        key = (len(self.extensions), self.logprobs is not None, [s.seq_id for s in rows])
        t, states = self.sampler.cached_tensors(key, offsets, lambda: self._build(rows, offsets, logits.shape[-1]))
        changes, lp_state = states if states is not None else ((), None)
        background = [ext.prepare(state, step) for ext, state in changes]
        draw = (logits, prompt_logits, t, changes, lp_state, suppress, n, check, step)
        if defer and any(background):
            self._deferred = DeferredTokens(lambda: self._draw(*draw))
            return self._deferred
        return self._draw(*draw)

    def flush(self) -> None:
        if self._deferred is not None:
            deferred, self._deferred = self._deferred, None
            deferred.queue()

    @torch.inference_mode()
    def _draw(self, logits, prompt_logits, t, changes, lp_state, suppress, n, check, step) -> PendingTokens:
        x = logits
        if changes:
            x = logits.to(torch.float32, copy=True)
            for ext, state in changes:
                ext.transform(x, state, step)
        if changes and suppress is not None:
            _suppress_unless_nothing_is_left(x, suppress)
            suppress = None  # (applied to x)
        tokens = self.sampler.sampler(x, t, suppress)
        copies = None
        if lp_state is not None or prompt_logits is not None:  # (TokenSampler.sample checked the reader is there)
            copies = self.logprobs.gather(lp_state, logits, tokens, prompt_logits, step)
        for ext, state in changes:
            ext.observe(state, tokens)
        self.sampler.prev_tokens[:n].copy_(tokens)
        return self.sampler.publish(n, check, copies)

    def _build(self, rows: list[Sequence], offsets: list[int], vocab: int):
        """(SamplingTensors, extension states): ([(extension, state)], logprobs state or None) for
        the extensions that apply to some row, or None when none does."""
        t = self.sampler.tensors(rows, offsets)
        changes, lp_state = [], None
        for ext in self.extensions:
            where = [i for i, s in enumerate(rows) if ext.applies(s.params)]
            if where:
                changes.append((ext, ext.build(rows, where, vocab)))
        if self.logprobs is not None:
            where = [i for i, s in enumerate(rows) if self.logprobs.applies(s.params)]
            if where:
                lp_state = self.logprobs.build(rows, where, vocab)
        return t, ((changes, lp_state) if changes or lp_state is not None else None)
