"""Batched token sampler: greedy, temperature, top-k, top-p, min-p and seeded sampling, on device.

Every row carries its own parameters. Sampling uses the Gumbel-max trick with noise from a
counter-based integer hash of (seed, offset, token id): a row's token depends only on its logits,
parameters and (seed, offset), not on its batch nor on any torch.Generator state. Nothing syncs
with the host or has data-dependent shapes, so the forward pass can be captured in a CUDA graph
(for fixed host-side flags, see SamplingTensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm.sampling_params import SamplingParams

_MASK32 = 0xFFFFFFFF
# lowbias32 multipliers (Wellons' hash prospector). The second is above 2**31; using it minus
# 2**32 gives the same product mod 2**32 while |x * m| stays below 2**63 for x < 2**32, so the
# int64 arithmetic never overflows, on any backend.
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B - (1 << 32)
_KEY_START = 0x9E3779B9  # arbitrary non-zero start so (seed 0, offset 0) is not special
_NEG_INF = float("-inf")
# top_k at or past this is the same as no top_k for any vocabulary (and fits int64).
_TOP_K_CAP = 1 << 31


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 avalanche hash (a bijection on 32-bit values), in place, on an int64 tensor
    holding values in [0, 2**32): intermediates stay below 2**63, so shifts are logical."""
    t = torch.bitwise_right_shift(x, 16)
    x.bitwise_xor_(t)
    x.mul_(_MUL1).bitwise_and_(_MASK32)
    torch.bitwise_right_shift(x, 15, out=t)
    x.bitwise_xor_(t)
    x.mul_(_MUL2).bitwise_and_(_MASK32)
    torch.bitwise_right_shift(x, 16, out=t)
    return x.bitwise_xor_(t)


def _row_keys(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """32-bit key per row from int64 seeds and offsets [B] (all 64 bits of each count)."""
    k = torch.full_like(seeds, _KEY_START)
    for v in (seeds, offsets):
        k = _mix32_(k ^ (v & _MASK32))
        k = _mix32_(k ^ ((v >> 32) & _MASK32))
    return k


def _token_hashes(vocab_size: int, device, start: int = 0) -> torch.Tensor:
    """lowbias32 of token ids start..start+vocab_size-1 [V], so that rows with related keys get
    unrelated noise (a vocabulary shard passes its first id)."""
    return _mix32_(torch.arange(start, start + vocab_size, dtype=torch.int64, device=device))


def hash_uniform(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int,
                 token_hashes: torch.Tensor | None = None) -> torch.Tensor:
    """Uniform noise [B, V] float32, a pure function of (seed, offset, token id) (int64 [B] each):
    (2j + 1) / 2**24 for a 23-bit hash j, never 0 or 1, so -log(-log u) is always finite."""
    if token_hashes is None:
        token_hashes = _token_hashes(vocab_size, seeds.device)
    h = _row_keys(seeds, offsets)[:, None] ^ token_hashes[None, :]
    _mix32_(h)
    # float32 holds 24 significant bits: 23 hash bits plus the odd 1/2**24 stay exact.
    return h.bitwise_right_shift_(9).to(torch.float32).mul_(2.0**-23).add_(2.0**-24)


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


def _kth_threshold(vals: torch.Tensor, t: SamplingTensors, width: int) -> torch.Tensor:
    """Each row's top_k-th value from its `width` largest, descending vals [B, width]: fp32 [B],
    -inf on rows without top-k."""
    k = t.top_ks.long().clamp(0, width)
    kth = vals.gather(1, (k - 1).clamp(min=0)[:, None]).squeeze(1)
    return torch.where(k > 0, kth.float(), _NEG_INF)


def _sorted_threshold(x: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Per-row logit threshold [B] of top-k followed by top-p (on the renormalised top-k set)."""
    vocab = x.shape[-1]
    width = vocab if t.sort_k < 0 else max(1, min(t.sort_k, vocab))
    # A partial top-k is much cheaper than a full sort when every row that filters caps k.
    if width * 8 <= vocab:
        vals, idx = torch.topk(x, width, dim=-1)
    else:
        vals, idx = torch.sort(x, dim=-1, descending=True)
    thr = _kth_threshold(vals, t, width)
    if not t.need_top_p:
        return thr
    if t.need_top_k:
        vals.masked_fill_(vals < thr[:, None], _NEG_INF)
    # Unnormalised probabilities in sorted order; compared against top_p * total below.
    top = vals[:, :1].clone()
    probs = vals.sub_(top).exp_()
    cum = probs.cumsum_(dim=-1)
    total = cum[:, -1:]
    if vals.shape[-1] < vocab:
        # Tokens tied with the k-th largest beyond the partial top-k belong to the top-k set too: its
        # mass is summed over the whole row (a row's tokens never depend on another's filters).
        total = torch.where(x >= thr[:, None], (x - top).exp(), 0.0).sum(dim=-1, keepdim=True)
    # Position j is kept while the mass before it is < top_p; position 0 always is.
    n_keep = (cum < t.top_ps[:, None] * total).sum(dim=-1) + 1
    n_keep = n_keep.clamp(max=width)
    last = idx.gather(1, (n_keep - 1)[:, None])
    thr_p = x.gather(1, last).squeeze(1)
    thr_p = torch.where(t.top_ps < 1.0, thr_p, _NEG_INF)
    return torch.maximum(thr, thr_p)


def _thresholds(x: torch.Tensor, t: SamplingTensors):
    """(threshold, argmax) [B] each for temperature-scaled fp32 logits x [B, V]: a token survives
    when its logit is >= the threshold (None: nothing filtered); the argmax (first maximum, which
    no filter removes) only when some row is greedy."""
    row_max = argmax = None
    if t.any_greedy or t.need_min_p:
        row_max, argmax = x.max(dim=-1)
    thr = None
    if t.need_top_k or t.need_top_p:
        thr = _sorted_threshold(x, t)
    if t.need_min_p:
        # p < min_p * p_max  <=>  logit < max_logit + log(min_p); ratios survive renormalisation.
        thr_m = row_max + torch.log(t.min_ps)
        thr = thr_m if thr is None else torch.maximum(thr, thr_m)
    return thr, argmax


def _scaled(logits: torch.Tensor, t: SamplingTensors, suppress) -> torch.Tensor:
    """New fp32 tensor: logits / temperature (greedy rows / 1), suppressed tokens -inf."""
    # Dividing a bf16/fp16 tensor by an fp32 one computes in fp32, so cast and scale are one pass.
    x = torch.div(logits, torch.where(t.temperatures > 0, t.temperatures, 1.0)[:, None])
    if suppress is not None:
        rows, cols = suppress
        x.index_put_((rows, cols), x.new_full((), _NEG_INF))
    return x


def _filtered(logits: torch.Tensor, t: SamplingTensors, suppress):
    """(apply_filters' scores, the argmax of each row or None: see _thresholds)."""
    x = _scaled(logits, t, suppress)
    thr, argmax = _thresholds(x, t)
    if thr is not None:
        x.masked_fill_(x < thr[:, None], _NEG_INF)
    return x, argmax


def apply_filters(logits: torch.Tensor, t: SamplingTensors,
                  suppress: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The distribution the sampler draws from, as fp32 logits [B, V] (a new tensor): suppressed
    tokens -inf, non-greedy rows divided by their temperature, then top-k keeps tokens >= the k-th
    largest logit; top-p the shortest prefix of the (top-k renormalised) sorted distribution whose
    mass reaches top_p; min-p drops tokens with p < min_p * p_max. Each filter is a per-row logit
    threshold, so ties with the last kept token are kept and the top token always survives.
    softmax of the result is the sampling distribution of non-greedy rows."""
    return _filtered(logits, t, suppress)[0]


class Sampler(torch.nn.Module):
    """Picks one token per row from logits [B, V] (fp32, bf16 or fp16) with torch ops; see
    SamplingTensors. A CUDA engine draws through fused kernels instead (core/triton_sampler.py)."""

    def __init__(self):
        super().__init__()
        self._token_hashes: dict[tuple[int, torch.device, int], torch.Tensor] = {}

    def add_gumbel_(self, x: torch.Tensor, t: SamplingTensors, first_id: int = 0) -> torch.Tensor:
        """x += the rows' Gumbel noise of token ids first_id, first_id + 1, ... (in place; x)."""
        key = (x.shape[-1], x.device, first_id)
        h = self._token_hashes.get(key)
        if h is None:
            h = self._token_hashes[key] = _token_hashes(*key)
        u = hash_uniform(t.seeds, t.offsets, x.shape[-1], h)
        # Gumbel-max: log p + Gumbel noise, with Gumbel = -log(E), E = -log(u) ~ Exp(1).
        return x.sub_(u.log_().neg_().log_())

    def forward(self, logits: torch.Tensor, t: SamplingTensors,
                suppress: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Token ids int64 [B]; logits is not modified. suppress: optional (rows, cols) int64 index
        tensors of logits that count as -inf (repeats are fine). Greedy rows take the first argmax;
        others draw argmax(filtered_logits - log(-log u)), u = hash_uniform."""
        if t.all_greedy:
            return (logits if suppress is None else _scaled(logits, t, suppress)).argmax(dim=-1)
        x, argmax = _filtered(logits, t, suppress)
        sampled = self.add_gumbel_(x, t).argmax(dim=-1)
        return torch.where(t.temperatures == 0, argmax, sampled) if t.any_greedy else sampled
