"""Logprobs of the sampled tokens and of prompt positions, from the raw logits (before any
logits extension or filter, as vLLM returns them). Plugs into core/hooks.py's LogprobsExtension;
the scheduler plans the prompt positions (StepInput.prompt_rows / prompt_targets /
prompt_owners), whose logits rows follow the sampling rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm.core.scheduler import ScheduledBatch
from nanovllm.core.sequence import Sequence, SequenceStatus
from nanovllm.model.attention import host_to_device
from nanovllm.sampling_params import SamplingParams


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


@dataclass
class StepLogprobs:
    """A step's logprob entries on the host (core/hooks.py's StepLogprobs): `sample[row]` for
    the sampling rows that asked, `prompt` as (batch row, entries of its next prompt positions)."""

    sample: dict[int, tuple]
    prompt: list[tuple[int, list[tuple]]]

    def add_prompt_entries(self, batch: ScheduledBatch) -> None:
        for row, entries in self.prompt:
            seq = batch.seqs[row]
            # A DRAINING one (max_tokens=1: its prompt step makes its only token) still takes
            # its prompt's logprobs; a FINISHED one (aborted meanwhile) does not.
            if seq.prompt_logprobs is not None and seq.status != SequenceStatus.FINISHED:
                seq.prompt_logprobs.extend(entries)

    def take(self, seq: Sequence, row: int) -> tuple:
        entry = self.sample[row]
        seq.logprobs.append(entry)
        seq.cumulative_logprob += entry[0]
        return entry


def _entries(vals: list[list[float]], ids: list[list[int]], k: int) -> list[tuple]:
    return [(v[0], i[0], i[1:k + 1], v[1:k + 1]) for v, i in zip(vals, ids)]


class LogprobCopies:
    """Logprob tensors of one step on their way to the host (pinned, non-blocking), and what the
    host needs to split them: sample rows and their k; prompt owners (row, positions, k).
    A PendingLogprobs (core/hooks.py)."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.sample = None  # (rows, ks, vals, ids)
        self.prompt = None  # (owners, vals, ids)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)
        host.copy_(t, non_blocking=self.pin)
        return host

    def add_sample(self, rows: list[int], ks: list[int], vals, ids) -> None:
        self.sample = (rows, ks, self._to_host(vals), self._to_host(ids))

    def add_prompt(self, owners: list[tuple[int, int, int]], vals, ids) -> None:
        self.prompt = (owners, self._to_host(vals), self._to_host(ids))

    def result(self) -> StepLogprobs:
        sample, prompt = {}, []
        if self.sample is not None:
            rows, ks, vals, ids = self.sample
            for row, k, v, i in zip(rows, ks, vals.tolist(), ids.tolist()):
                sample[row] = _entries([v], [i], k)[0]
        if self.prompt is not None:
            owners, vals, ids = self.prompt
            vals, ids, at = vals.tolist(), ids.tolist(), 0
            for row, count, k in owners:
                prompt.append((row, _entries(vals[at:at + count], ids[at:at + count], k)))
                at += count
        return StepLogprobs(sample, prompt)


@dataclass
class LogprobRows:
    """The batch rows that want their sampled tokens' logprobs, each one's k, and the rows on
    the device."""

    rows: list[int]
    ks: list[int]
    rows_t: torch.Tensor


class Logprobs:
    """LogprobsExtension: SamplingParams.logprobs (sampled tokens) and prompt_logprobs."""

    def __init__(self, device: torch.device, pin: bool):
        self.device, self.pin = device, pin

    def applies(self, params: SamplingParams) -> bool:
        return params.logprobs is not None

    def build(self, rows: list[Sequence], where: list[int], vocab_size: int) -> LogprobRows:
        ks = [rows[i].params.logprobs for i in where]
        return LogprobRows(where, [vocab_size if k < 0 else min(k, vocab_size) for k in ks],
                           host_to_device(where, torch.long, self.device, self.pin))

    def gather(self, state: LogprobRows | None, logits: torch.Tensor, tokens: torch.Tensor,
               prompt_logits: torch.Tensor | None, step) -> LogprobCopies:
        copies = LogprobCopies(self.pin)
        if state is not None:
            r = state.rows_t
            vals, ids = gather_logprobs(logits.index_select(0, r), tokens.index_select(0, r), max(state.ks))
            copies.add_sample(state.rows, state.ks, vals, ids)
        if prompt_logits is not None:
            targets = host_to_device(step.prompt_targets, torch.long, self.device, self.pin)
            vocab = prompt_logits.shape[-1]
            owners = [(row, count, vocab if want < 0 else min(want, vocab)) for row, count, want in step.prompt_owners]
            vals, ids = gather_logprobs(prompt_logits, targets, max(k for _, _, k in owners))
            copies.add_prompt(owners, vals, ids)
        return copies
