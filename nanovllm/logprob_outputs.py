"""Logprobs in vLLM's output form: `{token id: Logprob}` per position, the chosen token first,
each token's text decoded once per LLM (`_token_texts`). Mixed into LLM; the step API and the
server's preparers use the same methods."""

from __future__ import annotations

from nanovllm.core.detokenizer import decode_tokens
from nanovllm.core.sequence import Sequence
from nanovllm.outputs import Logprob
from nanovllm.sampling_params import SamplingParams


class LogprobOutputs:
    """Needs `tokenizer` and a `_token_texts` dict (token id -> text) on the object."""

    def _logprobs(self, seq: Sequence, entries, tokens) -> tuple[float | None, list | None]:
        """(cumulative_logprob, logprobs) of a completion in vLLM's form, or (None, None)."""
        if seq.logprobs is None:
            return None, None
        return seq.cumulative_logprob, [self._logprob_dict(e, t, seq.params) for e, t in zip(entries, tokens)]

    def _prompt_logprobs(self, seq: Sequence):
        if seq.prompt_logprobs is None:
            return None
        tokens = seq.prompt_token_ids[1:]
        return [None] + [self._logprob_dict(e, t, seq.params) for e, t in zip(seq.prompt_logprobs, tokens)]

    def _logprob_dict(self, entry: tuple, token: int, params: SamplingParams) -> dict[int, Logprob]:
        """{token id: Logprob} of one position: the chosen (sampled or prompt) token first,
        then the top ones (vLLM's layout: a chosen token among the top ones appears once)."""
        logprob, rank, top_ids, top_lps = entry
        texts = self._texts([token, *top_ids]) if params.detokenize and self.tokenizer is not None else None
        out = {token: Logprob(logprob, rank, texts and texts[0])}
        for j, (t, v) in enumerate(zip(top_ids, top_lps)):
            out[t] = Logprob(v, j + 1, texts and texts[j + 1])
        return out

    def _texts(self, ids: list[int]) -> list[str]:
        missing = [t for t in ids if t not in self._token_texts]
        if missing:
            self._token_texts.update(zip(missing, decode_tokens(self.tokenizer, missing)))
        return [self._token_texts[t] for t in ids]
