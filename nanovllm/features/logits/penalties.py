"""Repetition, frequency and presence penalties. Plugs into core/hooks.py's LogitsExtension.

Penalties need each request's token counts: `TokenCounts` keeps them on the device (one row per
request, updated from the sampled tokens on the device), so no step sends token histories to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm.core.sequence import Sequence
from nanovllm.model.attention import host_to_device
from nanovllm.sampling_params import SamplingParams


def apply_penalties(x: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor | None,
                    repetition: torch.Tensor | None, frequency: torch.Tensor | None,
                    presence: torch.Tensor | None) -> None:
    """In place on x[rows] (fp32 [B, V]), with counts [len(rows), V] int32 of each row's output
    tokens and in_prompt [len(rows), V] bool of its prompt tokens:

    repetition [m] (vLLM's and HF's rule): a token of the prompt or output gets its logit divided
    by the penalty when positive, multiplied by it otherwise; then
    logit -= frequency * count + presence * (count > 0) (OpenAI's / vLLM's formula, output
    tokens only). None skips a term (every row at its neutral value)."""
    xs = x[rows]
    if repetition is not None:
        seen = counts > 0
        if in_prompt is not None:
            seen |= in_prompt
        r = repetition[:, None]
        xs = torch.where(seen, torch.where(xs > 0, xs / r, xs * r), xs)
    if frequency is not None:
        xs = xs - frequency[:, None] * counts
    if presence is not None:
        xs = xs - presence[:, None] * (counts > 0)
    x[rows] = xs


class TokenCounts:
    """Token counts of the requests that use penalties, on the device, one slot per request:
    `counts` [slots, V] int32 (occurrences in the output so far) and `in_prompt` [slots, V] bool.

    A slot is filled once from the request's token ids (`assign`) and then kept current on the
    device by `add` with each step's sampled tokens: the host never sends a token history again,
    and with overlap scheduling the counts already hold tokens the host has not seen yet.
    Slots are freed when the request ends (`release`); the tensors grow (doubling) on demand.
    """

    def __init__(self, vocab_size: int, device):
        self.vocab_size, self.device = vocab_size, device
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.slots: dict[int, int] = {}  # request (seq_id) -> slot
        self._free: list[int] = []

    def slot(self, key: int) -> int | None:
        return self.slots.get(key)

    def assign(self, key: int, prompt_ids: list[int], output_ids: list[int]) -> int:
        """A slot for request `key`, filled from its token ids (all known to the host)."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self.slots[key] = slot
        self.counts[slot].zero_()
        self.in_prompt[slot].zero_()
        if prompt_ids:
            self.in_prompt[slot, torch.tensor(prompt_ids, dtype=torch.long).to(self.device)] = True
        if output_ids:
            ids = torch.tensor(output_ids, dtype=torch.long).to(self.device)
            self.counts[slot].index_put_((ids,), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
        return slot

    def release(self, key: int) -> None:
        slot = self.slots.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def add(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """counts[slots[i], tokens[i]] += 1 (slots distinct), on the device."""
        self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(4, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        in_prompt = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old] = self.counts
        in_prompt[:old] = self.in_prompt
        self.counts, self.in_prompt = counts, in_prompt
        self._free.extend(range(new - 1, old - 1, -1))


@dataclass
class PenaltyRows:
    """A batch's penalised rows: their batch rows and count slots, and each penalty per row
    (None when every row has it at its neutral value)."""

    rows: torch.Tensor
    slots: torch.Tensor
    repetition: torch.Tensor | None
    frequency: torch.Tensor | None
    presence: torch.Tensor | None


class Penalties:
    """LogitsExtension: the penalties, after logit_bias (vLLM's order)."""

    order = 20

    def __init__(self, device: torch.device, pin: bool):
        self.device, self.pin = device, pin
        self.counts: TokenCounts | None = None  # made at the first penalised batch (its vocabulary)

    def applies(self, params: SamplingParams) -> bool:
        return params.uses_penalties

    def build(self, rows: list[Sequence], where: list[int], vocab_size: int) -> PenaltyRows:
        if self.counts is None:
            self.counts = TokenCounts(vocab_size, self.device)
        slots = []
        for i in where:
            s = rows[i]
            slot = self.counts.slot(s.seq_id)
            if slot is None:  # first sampled here: every token of it is known to the host
                slot = self.counts.assign(s.seq_id, s.prompt_token_ids, s.completion_token_ids)
            slots.append(slot)
        ps = [rows[i].params for i in where]

        def per_row(name: str, neutral: float) -> torch.Tensor | None:
            values = [getattr(p, name) for p in ps]
            if all(v == neutral for v in values):
                return None
            return host_to_device(values, torch.float32, self.device, self.pin)

        return PenaltyRows(host_to_device(where, torch.long, self.device, self.pin),
                           host_to_device(slots, torch.long, self.device, self.pin),
                           per_row("repetition_penalty", 1.0), per_row("frequency_penalty", 0.0),
                           per_row("presence_penalty", 0.0))

    def prepare(self, state, step=None) -> bool:
        return False  # (all its work is on the device)

    def transform(self, logits: torch.Tensor, state: PenaltyRows, step=None) -> None:
        c = self.counts
        in_prompt = c.in_prompt.index_select(0, state.slots) if state.repetition is not None else None
        apply_penalties(logits, state.rows, c.counts.index_select(0, state.slots), in_prompt,
                        state.repetition, state.frequency, state.presence)

    def observe(self, state: PenaltyRows, tokens: torch.Tensor) -> None:
        self.counts.add(state.slots, tokens.index_select(0, state.rows))

    def release(self, seq: Sequence) -> None:
        if self.counts is not None:
            self.counts.release(seq.seq_id)
