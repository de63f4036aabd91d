"""The basic sampler's random route (core/sampler.py reaches it through RANDOM_DRAW, so a greedy
generate never loads it): temperature, top-k, top-p and min-p filters, and the seeded draw.

Sampling uses the Gumbel-max trick with noise from a counter-based integer hash of (seed, offset,
token id): a row's token depends only on its logits, parameters and (seed, offset), not on its
batch nor on any torch.Generator state. Nothing syncs with the host or has data-dependent shapes,
so the forward pass can be captured in a CUDA graph (for fixed host-side flags: SamplingTensors).
"""

from __future__ import annotations

import torch

from nanovllm.core.sampler import _NEG_INF, SamplingTensors, _scaled

_MASK32 = 0xFFFFFFFF
# lowbias32 multipliers (Wellons' hash prospector). The second is above 2**31; using it minus
# 2**32 gives the same product mod 2**32 while |x * m| stays below 2**63 for x < 2**32, so the
# int64 arithmetic never overflows, on any backend.
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B - (1 << 32)
_KEY_START = 0x9E3779B9  # arbitrary non-zero start so (seed 0, offset 0) is not special


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


def add_gumbel_(x: torch.Tensor, t: SamplingTensors, cache: dict, first_id: int = 0) -> torch.Tensor:
    """Sampler.add_gumbel_: x += the rows' Gumbel noise of token ids first_id, first_id + 1, ...
    (in place; x). `cache`: the sampler's token hashes by (vocab, device, first id)."""
    key = (x.shape[-1], x.device, first_id)
    h = cache.get(key)
    if h is None:
        h = cache[key] = _token_hashes(*key)
    u = hash_uniform(t.seeds, t.offsets, x.shape[-1], h)
    # Gumbel-max: log p + Gumbel noise, with Gumbel = -log(E), E = -log(u) ~ Exp(1).
    return x.sub_(u.log_().neg_().log_())


def draw(sampler, logits: torch.Tensor, t: SamplingTensors, suppress) -> torch.Tensor:
    """Sampler.forward when some row samples: greedy rows take the first argmax, the others
    argmax(apply_filters(logits) - log(-log u)), u = hash_uniform."""
    x, argmax = _filtered(logits, t, suppress)
    sampled = sampler.add_gumbel_(x, t).argmax(dim=-1)
    return torch.where(t.temperatures == 0, argmax, sampled) if t.any_greedy else sampled
