"""Each step's next tokens: sampled on the device, kept there for the next step, and sent to the
host in the background (overlap scheduling).

`TokenSampler` (one per rank) owns the device buffer of the last step's sampled tokens, from
which the next step takes the input token of every sequence whose last token the host has not
seen yet, and the pinned host copies the tokens travel through (`PendingTokens`). With tensor
parallelism it also decides who samples: every rank from its vocabulary shard (`RowSampling`,
rows with plain temperature sampling and nothing suppressed) or rank 0 from gathered logits.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.sampler import Sampler, SamplingTensors, filters_off, pick_candidates
from nanovllm.utils.context import host_to_device


def suppressed_tokens(seq: Sequence, eos_token_ids: frozenset[int]) -> set[int]:
    """Tokens `seq` may not sample yet (before min_tokens): its stop ids and, unless it
    ignores EOS, the EOS tokens."""
    if seq.num_completion_tokens >= seq.params.min_tokens:
        return set()
    return set(seq.params.stop_ids) | (set() if seq.params.ignore_eos else set(eos_token_ids))


@dataclass
class RowSampling:
    """What every tensor-parallel rank needs to sample its vocabulary shard, for rows whose
    filters are off (sampler.filters_off) and that suppress nothing: per-row temperature, seed
    and offset, as rank 0's TokenSampler.sample would use them."""

    temperatures: list[float]
    seeds: list[int]
    offsets: list[int]

    @classmethod
    def from_seqs(cls, seqs: list[Sequence]) -> "RowSampling":
        return cls([float(s.params.temperature) for s in seqs], [s.seed for s in seqs], [len(s) for s in seqs])

    @classmethod
    def for_every_rank(cls, seqs: list[Sequence], eos_token_ids: frozenset[int]) -> "RowSampling | None":
        """Sampling on every rank for these rows, or None when some row needs the whole vocabulary
        (top-k, top-p, min-p) or suppresses tokens: then rank 0 samples the gathered logits."""
        if all(filters_off(s.params) and not suppressed_tokens(s, eos_token_ids) for s in seqs):
            return cls.from_seqs(seqs)
        return None


class PendingTokens:
    """Sampled tokens on their way to the host; `result()` waits for them (and only for them).

    check: with tensor parallelism, raises once a peer died; then the wait polls the event and
    calls it meanwhile and after, since a dead peer's collectives may never finish, or finish
    (aborted) with garbage in the tokens."""

    def __init__(self, host: torch.Tensor, n: int, event, check=None):
        self._host, self._n, self._event, self._check = host, n, event, check

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


class TokenSampler:
    """Samples the next token of each row on one rank and hands the tokens to the host."""

    def __init__(self, max_rows: int, device: torch.device, tp):
        self.device, self.tp = device, tp
        self.pin = device.type == "cuda"
        self.sampler = Sampler()
        # The last step's sampled tokens, one row per scheduled sequence, kept on the device for
        # the next step's inputs; two pinned host copies alternate so that reading step n's
        # tokens never races with step n+1 writing its own.
        self.prev_tokens = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self._host = [torch.zeros(max_rows, dtype=torch.int32, pin_memory=self.pin) for _ in range(2)]
        self._events = [torch.cuda.Event() if self.pin else None for _ in range(2)]
        self._flip = 0
        self._cache = None  # (key, SamplingTensors) of the last step, see _tensors

    def input_tokens(self, ids: torch.Tensor, src_rows: torch.Tensor) -> torch.Tensor:
        """Input token per row: the host's, or (src >= 0) the previous step's sampled token that
        is still on the device. Part of the captured decode graph, so it costs no launches."""
        return torch.where(src_rows >= 0, self.prev_tokens.index_select(0, src_rows.clamp(min=0)), ids)

    def share_previous(self) -> None:
        """Only rank 0 sampled the previous step: hand its tokens to every rank, on the device."""
        self.tp.broadcast_from_rank0(self.prev_tokens)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: frozenset[int],
               check=None) -> PendingTokens:
        """The next token of each sequence from its logits row (rank 0), left in `prev_tokens`
        for the next step and copied to the host without blocking."""
        offsets = [len(s) for s in seqs]
        t = self._tensors([s.seq_id for s in seqs], offsets, lambda: SamplingTensors.build(
            [s.params for s in seqs], [s.seed for s in seqs], offsets, self.device, pin_memory=self.pin))
        rows, cols = [], []
        for i, s in enumerate(seqs):
            banned = suppressed_tokens(s, eos_token_ids)
            rows.extend([i] * len(banned))
            cols.extend(banned)
        suppress = None
        if rows:
            suppress = (host_to_device(rows, torch.long, self.device, self.pin),
                        host_to_device(cols, torch.long, self.device, self.pin))
        n = len(seqs)
        self.prev_tokens[:n].copy_(self.sampler(logits, t, suppress))
        return self.publish(n, check)

    @torch.inference_mode()
    def sample_shards(self, model, hidden: torch.Tensor, rows: RowSampling) -> torch.Tensor:
        """Tensor parallelism, rows without top-k/top-p/min-p or suppressed tokens: each rank
        offers its vocabulary shard's best candidate per row and every rank picks the same
        tokens from all candidates. Sends two numbers per row and rank instead of gathering
        [rows, vocab] logits on rank 0, and the next step needs no broadcast of the tokens."""
        key = ("rows", rows.temperatures, rows.seeds)  # never equal to sample()'s id list
        t = self._tensors(key, rows.offsets, lambda: SamplingTensors.temperature_only(
            rows.temperatures, rows.seeds, rows.offsets, self.device, self.pin))
        logits, first_id = model.compute_logit_shard(hidden)
        scores, ids = self.sampler.candidates(logits, t, first_id)
        # One collective for both: float64 holds the fp32 scores and the token ids exactly.
        every = self.tp.all_gather(torch.stack([scores.double(), ids.double()]))  # [ranks, 2, rows]
        tokens = pick_candidates(every[:, 0], every[:, 1].long())
        self.prev_tokens[:len(tokens)].copy_(tokens)
        return tokens

    def publish(self, n: int, check=None) -> PendingTokens:
        """Start copying the step's sampled tokens (`prev_tokens[:n]`) to the host (`check`:
        see PendingTokens)."""
        self._flip ^= 1
        host, event = self._host[self._flip], self._events[self._flip]
        host[:n].copy_(self.prev_tokens[:n], non_blocking=self.pin)
        if event is not None:
            event.record()
        return PendingTokens(host, n, event, check)

    def _tensors(self, key, offsets: list[int], build) -> SamplingTensors:
        """`build()`, or the last step's tensors with new offsets when `key` (what fixes the
        per-row parameters) is unchanged: consecutive decode steps usually sample the same rows
        with the same parameters, and then only the offsets (sequence lengths) change."""
        cached = self._cache
        if cached is not None and cached[0] == key:
            t = dataclasses.replace(cached[1], offsets=host_to_device(offsets, torch.long, self.device, self.pin))
        else:
            t = build()
        self._cache = (key, t)
        return t
