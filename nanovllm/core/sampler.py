"""Batched token sampler: temperature, top-k, top-p, min-p and seeded sampling, all on device.

Every row of a batch carries its own parameters. Sampling uses the Gumbel-max trick with noise
from a counter-based integer hash of (seed, offset, token id), so a row's token depends only
on its logits, its parameters and its (seed, offset): not on the batch it sits in, nor on any
torch.Generator state. Nothing here syncs with the host or has data-dependent shapes, so the
forward pass can be captured in a CUDA graph (for fixed host-side flags, see SamplingTensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton

    from nanovllm.kernels.sampling import gumbel_argmax_triton, gumbel_partials_triton
    from nanovllm.kernels.top_p import filtered_sample_triton
except ImportError:  # Triton only ships for Linux; the torch path covers the rest
    triton = None

from nanovllm.sampling_params import SamplingParams

_MASK32 = 0xFFFFFFFF
# lowbias32 multipliers (Wellons' hash prospector). The second is above 2**31; using it minus
# 2**32 gives the same product mod 2**32 while |x * m| stays below 2**63 for x < 2**32, so the
# int64 arithmetic never overflows, on any backend.
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B - (1 << 32)
_KEY_START = 0x9E3779B9  # arbitrary non-zero start so (seed 0, offset 0) is not special
_NEG_INF = float("-inf")


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 avalanche hash, in place, on an int64 tensor holding values in [0, 2**32).

    A bijection on 32-bit values. Every intermediate stays in [0, 2**63), so right shifts are
    logical and products exact.
    """
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
    """Uniform noise [B, V] float32 in (0, 1), a pure function of (seed, offset, token id).

    seeds, offsets: int64 [B]. Values are (2j + 1) / 2**24 for a 23-bit hash j, so they are
    never 0 or 1 and -log(-log u) is always finite.
    """
    if token_hashes is None:
        token_hashes = _token_hashes(vocab_size, seeds.device)
    h = _row_keys(seeds, offsets)[:, None] ^ token_hashes[None, :]
    _mix32_(h)
    # float32 holds 24 significant bits: 23 hash bits plus the odd 1/2**24 stay exact.
    return h.bitwise_right_shift_(9).to(torch.float32).mul_(2.0**-23).add_(2.0**-24)


# top_k at or past this is the same as no top_k for any vocabulary (and fits int64).
_TOP_K_CAP = 1 << 31

@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the logits' device, plus host-side flags.

    temperatures: float32 [B], 0 = greedy. top_ks: int32/int64 [B], <= 0 = off. top_ps: float32 [B],
    1 = off. min_ps: float32 [B], 0 = off. seeds: int64 [B]. offsets: int64 [B], a per-row
    counter (the engine passes the sequence's current length) that advances the random stream.
    The flags are decided on the host and pick which device work runs; a CUDA graph captured
    with one set of flags is only valid for batches with the same flags.
    sort_k: how many of each row's largest logits the top-k/top-p step must see (the largest
    top_k, or -1 for the whole vocabulary when some row uses top_p without top_k).
    max_top_k: the largest top_k of any row (0 = none).
    """

    temperatures: torch.Tensor
    top_ks: torch.Tensor
    top_ps: torch.Tensor
    min_ps: torch.Tensor
    seeds: torch.Tensor
    offsets: torch.Tensor
    all_greedy: bool
    any_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    sort_k: int = -1
    max_top_k: int = 0

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], offsets: list[int],
              device, pin_memory: bool = False) -> SamplingTensors:
        """Build from host lists, one host->device copy per tensor (non-blocking if pinned).

        Seeds are taken mod 2**64. Greedy rows get their filters switched off, so they never
        cause a sort.
        """
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
        return cls(
            temperatures=to_dev(temps, torch.float32),
            top_ks=to_dev(ks, torch.int64),
            top_ps=to_dev(ps, torch.float32),
            min_ps=to_dev(mps, torch.float32),
            seeds=to_dev(wrapped, torch.int64),
            offsets=to_dev(list(offsets), torch.int64),
            all_greedy=n_greedy == len(temps),
            any_greedy=n_greedy > 0,
            need_top_k=any(k > 0 for k in ks),
            need_top_p=any(x < 1.0 for x in ps),
            need_min_p=any(x > 0.0 for x in mps),
            sort_k=sort_k,
            max_top_k=max(ks, default=0),
        )

    @classmethod
    def temperature_only(cls, temps: list[float], seeds: list[int], offsets: list[int], device,
                         pin_memory: bool = False) -> SamplingTensors:
        """Rows that sample from the plain temperature-scaled distribution (or greedily)."""
        n = len(temps)
        return cls.from_lists(temps, [0] * n, [1.0] * n, [0.0] * n, seeds, offsets, device, pin_memory)


def filters_off(p: SamplingParams) -> bool:
    """Whether `p` draws from the plain temperature-scaled distribution (greedy rows always do):
    then a row's token is the best of per-vocabulary-shard candidates (see Sampler.candidates)."""
    return p.temperature == 0.0 or (p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0)


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
        # Tokens tied with the k-th largest beyond the partial top-k belong to the top-k set too:
        # its mass is summed over the whole row (so a row's tokens do not depend on whether
        # another row's filters made this a full sort).
        total = torch.where(x >= thr[:, None], (x - top).exp(), 0.0).sum(dim=-1, keepdim=True)
    # Position j is kept while the mass before it is < top_p; position 0 always is.
    n_keep = (cum < t.top_ps[:, None] * total).sum(dim=-1) + 1
    n_keep = n_keep.clamp(max=width)
    last = idx.gather(1, (n_keep - 1)[:, None])
    thr_p = x.gather(1, last).squeeze(1)
    thr_p = torch.where(t.top_ps < 1.0, thr_p, _NEG_INF)
    return torch.maximum(thr, thr_p)


def _thresholds(x: torch.Tensor, t: SamplingTensors):
    """(threshold, argmax) for temperature-scaled fp32 logits x [B, V], each [B] or None.

    A token survives when its logit is >= the threshold; None means nothing is filtered.
    The argmax [B] (first maximum, which no filter removes) comes back when some row is
    greedy, else None.
    """
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


def apply_filters(logits: torch.Tensor, t: SamplingTensors,
                  suppress: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The distribution the sampler draws from, as fp32 logits [B, V] (a new tensor).

    Suppressed tokens are -inf, non-greedy rows are divided by their temperature, then:
    top-k keeps tokens >= the k-th largest logit; top-p keeps the shortest prefix of the
    (top-k renormalised) sorted distribution whose mass reaches top_p; min-p drops tokens with
    p < min_p * p_max. Each filter is a per-row logit threshold, so tokens tied with the last
    kept one are kept as well, and the top token always survives. softmax of the result is
    the sampling distribution of non-greedy rows.
    """
    x = _scaled(logits, t, suppress)
    thr, _ = _thresholds(x, t)
    if thr is not None:
        x.masked_fill_(x < thr[:, None], _NEG_INF)
    return x


def pick_candidates(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The token of each row from candidates [R, B] (float scores, integer token ids) of R
    vocabulary shards in vocabulary order: the best score, ties to the lowest id, as an
    argmax over the whole vocabulary would pick. Token ids int64 [B]."""
    best = scores.argmax(dim=0, keepdim=True)  # the first maximum: the lowest shard
    return ids.gather(0, best).squeeze(0)


def _use_triton(x: torch.Tensor) -> bool:
    """Whether Sampler draws x's tokens with the fused Triton kernel rather than torch ops."""
    return x.is_cuda and triton is not None


def _fuse_scaling(logits: torch.Tensor, t: SamplingTensors, suppress) -> bool:
    """Whether Sampler can hand the raw logits to the kernel, which then divides by temperature.

    Only when nothing but the kernel reads the scaled logits: every row samples (no greedy
    argmax), no filter needs a threshold and no token is suppressed. This skips _scaled's fp32
    [B, V] copy, which at large batches costs more than the kernel.
    """
    return (_use_triton(logits) and logits.stride(-1) == 1 and suppress is None
            and not (t.any_greedy or t.need_top_k or t.need_top_p or t.need_min_p))


class Sampler(torch.nn.Module):
    """Picks one token per row from logits [B, V] (fp32, bf16 or fp16); see SamplingTensors.

    On CUDA (with Triton) noise, masking and argmax are fused kernels: gumbel_argmax_triton when
    every row samples from its plain temperature distribution, else filtered_sample_triton,
    which finds top-p's token without sorting (kernels/top_p.py); both scale the raw logits
    themselves unless tokens are suppressed. Elsewhere they are torch ops over [B, V]
    temporaries. Both compute the same integer hash, so they agree except where float rounding
    of log() flips a near-tie, or of the probability mass sums moves a token across top-p's cut.
    fused_filters=False keeps the older CUDA route for filters (scaled fp32 copy, top-k or a
    full sort, then gumbel_argmax_triton with a threshold), for A/B measurements.
    """

    def __init__(self, fused_filters: bool = True):
        super().__init__()
        self.fused_filters = fused_filters
        self._token_hashes: dict[tuple[int, torch.device, int], torch.Tensor] = {}

    def _hashes(self, vocab_size: int, device: torch.device, start: int = 0) -> torch.Tensor:
        key = (vocab_size, device, start)
        h = self._token_hashes.get(key)
        if h is None:
            h = self._token_hashes[key] = _token_hashes(vocab_size, device, start)
        return h

    def _add_gumbel_(self, x: torch.Tensor, t: SamplingTensors, first_id: int = 0) -> torch.Tensor:
        """x += the rows' Gumbel noise of token ids first_id, first_id + 1, ... (in place; x)."""
        u = hash_uniform(t.seeds, t.offsets, x.shape[-1], self._hashes(x.shape[-1], x.device, first_id))
        # Gumbel-max: log p + Gumbel noise, with Gumbel = -log(E), E = -log(u) ~ Exp(1).
        return x.sub_(u.log_().neg_().log_())

    def forward(self, logits: torch.Tensor, t: SamplingTensors,
                suppress: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Token ids int64 [B]. logits is not modified.

        suppress: optional (rows, cols) pair of int64 index tensors on the logits' device;
        logits[rows[i], cols[i]] is treated as -inf (repeats are fine). Greedy rows take the
        first argmax; others draw argmax(filtered_logits - log(-log u)) with u = hash_uniform.
        """
        if t.all_greedy and suppress is None:
            return logits.argmax(dim=-1)
        if _fuse_scaling(logits, t, suppress):
            return gumbel_argmax_triton(logits, None, t.seeds, t.offsets, t.temperatures)
        if self.fused_filters and not t.all_greedy and _use_triton(logits):
            tokens = self._fused_filtered(logits, t, suppress)
            if tokens is not None:
                return tokens
        x = _scaled(logits, t, suppress)
        if t.all_greedy:
            return x.argmax(dim=-1)
        thr, argmax = _thresholds(x, t)
        if _use_triton(x):
            sampled = gumbel_argmax_triton(x, thr, t.seeds, t.offsets)
        else:
            if thr is not None:
                x.masked_fill_(x < thr[:, None], _NEG_INF)
            sampled = self._add_gumbel_(x, t).argmax(dim=-1)
        if t.any_greedy:
            sampled = torch.where(t.temperatures == 0, argmax, sampled)
        return sampled

    def _fused_filtered(self, logits: torch.Tensor, t: SamplingTensors, suppress) -> torch.Tensor | None:
        """forward's tokens through filtered_sample_triton, or None when some row's top_k is too
        large for a partial top-k (the sorting route then).

        Used for min-p, top-k and greedy rows too, not only top-p: reading the raw logits once
        beats writing and rereading their fp32 copy (and a separate argmax pass for greedy rows).
        """
        vocab = logits.shape[-1]
        width = max(1, min(t.max_top_k, vocab))
        if t.need_top_k and width * 8 > vocab:
            return None
        x, scale = logits, True
        if suppress is not None or logits.stride(-1) != 1:
            x, scale = _scaled(logits, t, suppress), False
        thr = None
        if t.need_top_k:
            # On the raw logits: x -> x / T (correctly rounded, T > 0) never reverses an order, so
            # the k-th largest of the scores is the k-th largest logit divided by T, which is
            # what the kernel compares the scores with. Holds for fp32 too, where division may
            # merge neighbours: the tokens tied with the threshold after division are kept.
            thr = _kth_threshold(torch.topk(x, width, dim=-1).values, t, width)
        return filtered_sample_triton(x, t.temperatures, thr, t.top_ps if t.need_top_p else None,
                                      torch.log(t.min_ps) if t.need_min_p else None, t.seeds, t.offsets,
                                      scale=scale)

    def candidates(self, logits: torch.Tensor, t: SamplingTensors, first_id: int = 0):
        """One vocabulary shard's candidate per row: (score fp32 [B], token id int64 [B]).

        logits [B, V_shard] hold tokens first_id, first_id + 1, ...; the rows must have their
        filters off (see filters_off) and nothing suppressed. Greedy rows offer their largest
        logit, the others their best logit / temperature + Gumbel noise (the same noise of the
        same token ids as forward), so pick_candidates over every shard's candidates is
        forward's token over the whole vocabulary. With tensor parallelism each rank sends
        these two numbers per row instead of its [B, V_shard] logits.
        """
        if t.need_top_k or t.need_top_p or t.need_min_p:
            raise ValueError("Sampler.candidates: top-k, top-p and min-p need the whole vocabulary")
        if logits.shape[-1] == 0:  # a last shard that holds only padding (tiny vocabularies)
            n = logits.shape[0]
            return (torch.full((n,), _NEG_INF, device=logits.device),
                    torch.full((n,), first_id, dtype=torch.int64, device=logits.device))
        greedy = logits.max(dim=-1) if t.any_greedy else None
        if t.all_greedy:
            return greedy.values.float(), greedy.indices + first_id
        temps = torch.where(t.temperatures > 0, t.temperatures, 1.0)
        if _use_triton(logits) and logits.stride(-1) == 1:
            vals, idx = gumbel_partials_triton(logits, None, t.seeds, t.offsets, temps, first_id=first_id)
            best = vals.argmax(dim=-1, keepdim=True)
            scores, ids = vals.gather(1, best).squeeze(1), idx.gather(1, best).squeeze(1).long()
        else:
            scores, ids = self._add_gumbel_(torch.div(logits, temps[:, None]), t, first_id).max(dim=-1)
            ids = ids + first_id
        if greedy is not None:
            is_greedy = t.temperatures == 0
            scores = torch.where(is_greedy, greedy.values.float(), scores)
            ids = torch.where(is_greedy, greedy.indices + first_id, ids)
        return scores, ids
