"""Per-request changes to the logits before sampling, and log-probabilities, on the device.

vLLM's order (V1 sampler): allowed_token_ids, bad words, logit_bias, then the repetition,
frequency and presence penalties, all on the raw fp32 logits; temperature, top-k/top-p/min-p
and the draw follow in layers/sampler.py. Every function works on the rows that ask (row index
tensors), so a batch mixing requests that use none of it pays nothing for them; the engine skips
all of it when no row of a step asks (engine/sampling.py).

Penalties need each request's token counts: `TokenCounts` keeps them on the device (one row per
request, updated from the sampled tokens on the device), so no step sends token histories to it.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax of logits [R, V] (any float dtype, computed in fp32) at `targets` [R] int64,
    with ranks, and the top `k` (0 <= k <= V) of each row.

    Returns (values fp32 [R, 1 + k], ids int64 [R, 1 + k]): column 0 holds the target's logprob
    and its rank (1 + the number of other tokens at least as likely: vLLM's count of logprobs
    >= the target's, so tied tokens share the larger rank); columns 1.. the top-k logprobs in
    descending order and their token ids.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    target = lp.gather(1, targets[:, None])
    rank = (lp >= target).sum(dim=-1, keepdim=True)
    if k == 0:
        return target, rank
    top, ids = lp.topk(k, dim=-1)
    return torch.cat([target, top], dim=1), torch.cat([rank, ids], dim=1)


def mask_to_allowed(x: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> None:
    """In place: x[rows[i], j] = -inf wherever allowed [len(rows), V] bool is False."""
    x[rows] = x[rows].masked_fill_(~allowed, _NEG_INF)


def ban(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, active: torch.Tensor | None = None) -> None:
    """In place: x[rows[i], cols[i]] = -inf (only where active[i], a bool tensor, if given).
    Repeated (row, col) pairs are fine: -inf is added, and -inf + anything finite is -inf."""
    add = x.new_full(rows.shape, _NEG_INF)
    if active is not None:
        add = torch.where(active, add, 0.0)
    x.index_put_((rows, cols), add, accumulate=True)


def add_bias(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, bias: torch.Tensor) -> None:
    """In place: x[rows[i], cols[i]] += bias[i] (logit_bias)."""
    x.index_put_((rows, cols), bias, accumulate=True)


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
