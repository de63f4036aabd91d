"""Logprobs in vLLM's output form: `{token id: Logprob}` per position, the chosen token first,
each token's text decoded once per LLM (its `_token_texts`). Loaded, through wiring/, by the
first request that asks for logprobs (or the first that names `nanovllm.outputs.Logprob`, which
this module defines); the server's preparers decode first tokens with token_texts."""

from __future__ import annotations

from dataclasses import dataclass

from nanovllm.core.detokenizer import decoder
from nanovllm.sampling_params import SamplingParams


@dataclass
class Logprob:
    """One token's log-probability (vLLM's Logprob): `logprob`, its `rank` in the model's
    distribution (1 = most likely; ties share the larger rank), and the token's text
    (`decoded_token`, None with detokenize=False)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token, {token id: Logprob} of the sampled token and the top `logprobs` tokens.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token: None for the first one (nothing predicts it), then as SampleLogprobs.
PromptLogprobs = list[dict[int, Logprob] | None]


def logprob_dicts(owner, entries, tokens, params: SamplingParams) -> list[dict[int, Logprob]]:
    """One {token id: Logprob} per position of the (logprob, rank, top ids, top logprobs)
    `entries` of the chosen `tokens`. `owner`: an LLM (or a server's preparer), whose
    `tokenizer` and `_token_texts` dict (token id -> text) give the tokens' texts."""
    return [_logprob_dict(owner, e, t, params) for e, t in zip(entries, tokens)]


def _logprob_dict(owner, entry: tuple, token: int, params: SamplingParams) -> dict[int, Logprob]:
    """{token id: Logprob} of one position: the chosen (sampled or prompt) token first, then the
    top ones (vLLM's layout: a chosen token among the top ones appears once)."""
    logprob, rank, top_ids, top_lps = entry
    texts = token_texts(owner, [token, *top_ids]) if params.detokenize and owner.tokenizer is not None else None
    out = {token: Logprob(logprob, rank, texts and texts[0])}
    for j, (t, v) in enumerate(zip(top_ids, top_lps)):
        out[t] = Logprob(v, j + 1, texts and texts[j + 1])
    return out


def token_texts(owner, ids: list[int]) -> list[str]:
    """The texts of token `ids`, each decoded once per `owner` (kept in its `_token_texts`)."""
    missing = [t for t in ids if t not in owner._token_texts]
    if missing:  # each token decoded alone, special tokens kept (Logprob.decoded_token)
        decode = decoder(owner.tokenizer, skip_special_tokens=False)
        owner._token_texts.update((t, decode([t])) for t in missing)
    return [owner._token_texts[t] for t in ids]
