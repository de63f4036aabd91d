"""Prompt-lookup drafting (vLLM's "ngram" method): the tokens that followed the latest n tokens
where they occurred earlier in the request's prompt or output."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from nanovllm.features.speculative.drafting import take_draft_slots


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens: for the longest n in [n_min, n_max] whose last n tokens occur earlier in
    `tokens`, the tokens after their earliest such occurrence (vLLM's rule); [] without a match."""
    if k < 1 or len(tokens) <= n_min:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, len(arr) - 1), n_min - 1, -1):
        # Windows starting before the suffix itself, each followed by at least one token.
        windows = sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return arr[start:start + k].tolist()
    return []


class NgramProposer:
    """The "ngram" method's Proposer (drafting.py): prompt lookup on the host."""

    def __init__(self, n_min: int, n_max: int, pad: bool = False):
        """`pad`: always k drafts, the lookup's then copies of the newest token (synthetic
        acceptance keeps drafts whatever they are)."""
        self.n_min, self.n_max, self.pad = n_min, n_max, pad

    def propose_one(self, seq, k: int) -> list[int]:
        d = propose_ngram(seq.token_ids, k, self.n_min, self.n_max)
        return d + [seq.token_ids[-1]] * (k - len(d)) if self.pad else d

    def propose(self, seqs: list, ks: list[int], block_manager) -> list[list[int]]:
        out = []
        for seq, k in zip(seqs, ks):
            d = self.propose_one(seq, k)
            if d and take_draft_slots(block_manager, seq, len(d)):
                out.append(d)
            else:
                out.append([])
        return out

    def verified(self, seq, drafted: int, accepted: int) -> None:
        pass  # nothing kept per request
