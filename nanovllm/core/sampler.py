"""Batched token sampler: greedy here; temperature, top-k, top-p, min-p and seeded sampling in
core/random_draw.py (Gumbel-max over hashed noise, on device), loaded at the first non-greedy row.
Every row carries its own parameters (SamplingTensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm.sampling_params import SamplingParams

_NEG_INF = float("-inf")
# top_k at or past this is the same as no top_k for any vocabulary (and fits int64).
_TOP_K_CAP = 1 << 31
RANDOM_DRAW = None  # filled by nanovllm.wiring: loads core/random_draw.py at the first non-greedy row


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the logits' device, plus host-side flags that pick which
    device work runs (a CUDA graph captured with one set of flags serves the same flags only)."""

    temperatures: torch.Tensor  # float32 [B], 0 = greedy
    top_ks: torch.Tensor  # int64 [B], <= 0 = off
    top_ps: torch.Tensor  # float32 [B], 1 = off
    min_ps: torch.Tensor  # float32 [B], 0 = off
    seeds: torch.Tensor  # int64 [B]
    offsets: torch.Tensor  # int64 [B]: a per-row counter (the sequence's length) advancing the random stream
    all_greedy: bool
    any_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    # How many of each row's largest logits top-k/top-p must see: the largest top_k, or -1 for
    # the whole vocabulary when some row uses top_p without top_k.
    sort_k: int = -1
    max_top_k: int = 0  # the largest top_k of any row (0 = none)

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], offsets: list[int],
              device, pin_memory: bool = False) -> SamplingTensors:
        """One host->device copy per tensor (non-blocking if pinned); seeds taken mod 2**64. Greedy
        rows get their filters switched off, so they never cause a sort."""
        temps, ks, ps, mps = [], [], [], []
        for p in params:
            greedy = p.temperature == 0.0
            temps.append(float(p.temperature))
            # Any k past the vocabulary keeps every token; clamped so that it fits an int64.
            ks.append(min(p.top_k, _TOP_K_CAP) if p.top_k > 0 and not greedy else 0)
            ps.append(1.0 if greedy else float(p.top_p))
            mps.append(0.0 if greedy else float(p.min_p))
        return cls.from_lists(temps, ks, ps, mps, seeds, offsets, device, pin_memory)

    @classmethod
    def from_lists(cls, temps: list[float], ks: list[int], ps: list[float], mps: list[float],
                   seeds: list[int], offsets: list[int], device, pin_memory: bool = False) -> SamplingTensors:
        """Build from per-row values whose filters are already off (0, 1.0, 0.0) on greedy rows."""
        sort_k = 0
        for k, top_p in zip(ks, ps):
            if top_p < 1.0 and k == 0:
                sort_k = -1
            elif sort_k >= 0:
                sort_k = max(sort_k, k)
        wrapped = [((s + (1 << 63)) & ((1 << 64) - 1)) - (1 << 63) for s in seeds]

        def to_dev(data, dtype):
            host = torch.tensor(data, dtype=dtype, pin_memory=pin_memory)
            return host.to(device, non_blocking=pin_memory)

        n_greedy = sum(1 for x in temps if x == 0.0)
        return cls(temperatures=to_dev(temps, torch.float32), top_ks=to_dev(ks, torch.int64),
                   top_ps=to_dev(ps, torch.float32), min_ps=to_dev(mps, torch.float32),
                   seeds=to_dev(wrapped, torch.int64), offsets=to_dev(list(offsets), torch.int64),
                   all_greedy=n_greedy == len(temps), any_greedy=n_greedy > 0,
                   need_top_k=any(k > 0 for k in ks), need_top_p=any(x < 1.0 for x in ps),
                   need_min_p=any(x > 0.0 for x in mps), sort_k=sort_k, max_top_k=max(ks, default=0))

    @property
    def filters(self) -> bool:
        """Whether some row has top-k, top-p or min-p."""
        return self.need_top_k or self.need_top_p or self.need_min_p


def _scaled(logits: torch.Tensor, t: SamplingTensors, suppress) -> torch.Tensor:
    """New fp32 tensor: logits / temperature (greedy rows / 1), suppressed tokens -inf."""
    # Dividing a bf16/fp16 tensor by an fp32 one computes in fp32, so cast and scale are one pass.
    x = torch.div(logits, torch.where(t.temperatures > 0, t.temperatures, 1.0)[:, None])
    if suppress is not None:
        rows, cols = suppress
        x.index_put_((rows, cols), x.new_full((), _NEG_INF))
    return x


class Sampler(torch.nn.Module):
    """Picks one token per row from logits [B, V] (fp32, bf16 or fp16) with torch ops; see
    SamplingTensors. A CUDA engine draws through fused kernels instead (core/triton_sampler.py)."""

    def __init__(self):
        super().__init__()
        self._token_hashes: dict[tuple[int, torch.device, int], torch.Tensor] = {}  # random_draw's

    def add_gumbel_(self, x: torch.Tensor, t: SamplingTensors, first_id: int = 0) -> torch.Tensor:
        """x += the rows' Gumbel noise of token ids first_id, first_id + 1, ... (in place; x)."""
        return RANDOM_DRAW().add_gumbel_(x, t, self._token_hashes, first_id)

    def forward(self, logits: torch.Tensor, t: SamplingTensors,
                suppress: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Token ids int64 [B]; logits is not modified. suppress: optional (rows, cols) int64 index
        tensors of logits that count as -inf (repeats are fine). Greedy rows take the first argmax;
        others draw with core/random_draw.py."""
        if t.all_greedy:
            return (logits if suppress is None else _scaled(logits, t, suppress)).argmax(dim=-1)
        return RANDOM_DRAW().draw(self, logits, t, suppress)
