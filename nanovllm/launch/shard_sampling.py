"""Tensor-parallel sampling from vocabulary shards: for rows that draw from their plain
temperature distribution (or greedily), every rank offers its shard's best candidate per row and
every rank picks the same token from all candidates. That sends two numbers per row and rank
instead of gathering [rows, vocab] logits on rank 0, and the next step needs no broadcast of
the tokens. `RowSampling.for_every_rank` is THE decision of a step (the launchers call it);
other steps are sampled by rank 0 from the gathered logits (TokenSampler.sample).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanovllm.core.sampler import Sampler, SamplingTensors
from nanovllm.core.sampling import TokenSampler, suppressed_tokens
from nanovllm.core.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

try:
    from nanovllm.kernels.sampling import gumbel_partials_triton
except ImportError:  # no Triton: _use_triton is False
    gumbel_partials_triton = None

_NEG_INF = float("-inf")


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and gumbel_partials_triton is not None


def filters_off(p: SamplingParams) -> bool:
    """Whether `p` draws from the plain temperature-scaled distribution (greedy rows always do):
    then a row's token is the best of per-vocabulary-shard candidates (see candidates)."""
    return p.temperature == 0.0 or (p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0)


def needs_gathered_logits(seq: Sequence, eos_token_ids: frozenset[int]) -> bool:
    """Whether a row must be sampled from the whole vocabulary's logits (rank 0): top-k, top-p
    or min-p, tokens suppressed by min_tokens, penalties, logit_bias, allowed_token_ids,
    bad_words or logprobs."""
    p = seq.params
    return (not filters_off(p) or p.processes_logits or p.logprobs is not None
            or bool(suppressed_tokens(seq, eos_token_ids)))


def samples_on_every_rank(rows: list[Sequence], eos_token_ids: frozenset[int], prompt_logprobs: bool) -> bool:
    """Every rank samples its vocabulary shard only when no row needs gathered logits and no
    prompt logprobs are computed (they need the whole vocabulary too)."""
    return not prompt_logprobs and not any(needs_gathered_logits(s, eos_token_ids) for s in rows)


def temperature_only(temps: list[float], seeds: list[int], offsets: list[int], device,
                     pin_memory: bool = False) -> SamplingTensors:
    """SamplingTensors of rows that sample from the plain temperature-scaled distribution."""
    n = len(temps)
    return SamplingTensors.from_lists(temps, [0] * n, [1.0] * n, [0.0] * n, seeds, offsets, device, pin_memory)


def candidates(sampler: Sampler, logits: torch.Tensor, t: SamplingTensors, first_id: int = 0):
    """One vocabulary shard's candidate per row: (score fp32 [B], token id int64 [B]).

    logits [B, V_shard] hold tokens first_id, first_id + 1, ...; the rows must have their
    filters off and nothing suppressed. Greedy rows offer their largest logit, the others their
    best logit / temperature + Gumbel noise (the same noise of the same token ids as
    Sampler.forward), so pick_candidates over every shard's candidates is forward's token.
    """
    if t.filters:
        raise ValueError("shard candidates: top-k, top-p and min-p need the whole vocabulary")
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
        scores, ids = sampler.add_gumbel_(torch.div(logits, temps[:, None]), t, first_id).max(dim=-1)
        ids = ids + first_id
    if greedy is not None:
        is_greedy = t.temperatures == 0
        scores = torch.where(is_greedy, greedy.values.float(), scores)
        ids = torch.where(is_greedy, greedy.indices + first_id, ids)
    return scores, ids


def pick_candidates(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The token of each row from candidates [R, B] (float scores, integer token ids) of R
    vocabulary shards in vocabulary order: the best score, ties to the lowest id, as an
    argmax over the whole vocabulary would pick. Token ids int64 [B]."""
    best = scores.argmax(dim=0, keepdim=True)  # the first maximum: the lowest shard
    return ids.gather(0, best).squeeze(0)


@dataclass
class RowSampling:
    """What every rank needs to sample its vocabulary shard (StepInput.sampling): per-row
    temperature, seed and offset, as rank 0's TokenSampler.sample would use them."""

    temperatures: list[float]
    seeds: list[int]
    offsets: list[int]

    @classmethod
    def for_every_rank(cls, rows: list[Sequence], eos_token_ids: frozenset[int],
                       prompt_logprobs: bool = False, offsets: list[int] | None = None) -> RowSampling | None:
        """Sampling on every rank for these rows, or None when rank 0 must sample the gathered
        logits (see samples_on_every_rank). `offsets`: StepInput.sample_offsets (drafts)."""
        if not samples_on_every_rank(rows, eos_token_ids, prompt_logprobs):
            return None
        return cls([float(s.params.temperature) for s in rows], [s.seed for s in rows],
                   offsets or [len(s) for s in rows])

    def sample(self, sampler: TokenSampler, model, hidden: torch.Tensor) -> torch.Tensor:
        """The rows' tokens on every rank (also left in the sampler's device buffer)."""
        return sample_shards(sampler, model, hidden, self)


def logit_shard(head, hidden: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's logits [rows, n] from its shard of the LM head (model/layers/embed_head.py's
    ParallelLMHead) of tokens first_id .. first_id + n - 1 (the last shard's padding columns left
    out; n may be 0 for tiny vocabularies), and first_id; no communication."""
    valid = max(0, min(head.shard_size, head.num_embeddings - head.vocab_start))
    # The same product as the head's forward (then sliced), so both paths see bitwise the same logits.
    return F.linear(hidden, head.weight)[:, :valid], head.vocab_start


@torch.inference_mode()
def sample_shards(sampler: TokenSampler, model, hidden: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """Each rank's candidates from its shard of the LM head's logits, all gathered, the same
    tokens picked on every rank."""
    key = ("rows", rows.temperatures, rows.seeds)  # never equal to TokenSampler.sample's id list
    t, _ = sampler.cached_tensors(key, rows.offsets, lambda: (temperature_only(
        rows.temperatures, rows.seeds, rows.offsets, sampler.device, sampler.pin), None))
    logits, first_id = logit_shard(model.lm_head, hidden)
    scores, ids = candidates(sampler.sampler, logits, t, first_id)
    # One collective for both: float64 holds the fp32 scores and the token ids exactly.
    every = sampler.tp.all_gather(torch.stack([scores.double(), ids.double()]))  # [ranks, 2, rows]
    tokens = pick_candidates(every[:, 0], every[:, 1].long())
    sampler.prev_tokens[:len(tokens)].copy_(tokens)
    return tokens
