"""rejection_sample_method="synthetic": drafts kept at a given rate whatever they are, so that
random weights (which accept nothing) can measure the speed a real acceptance rate would give.
The tokens are then not the model's: for benchmarks only (vLLM's option of the same name)."""

from __future__ import annotations

import xxhash


class SyntheticAcceptance:
    """Drafting.acceptance (drafting.py): draft j is kept with probability rates[j] once drafts
    0..j-1 were, by a draw that depends only on the request's seed and the token's index."""

    def __init__(self, rates: tuple[float, ...]):
        self.rates = rates

    @staticmethod
    def _uniform(seed: int, index: int) -> float:
        h = xxhash.xxh64((seed % (1 << 64)).to_bytes(8, "little"))
        h.update(index.to_bytes(8, "little"))
        return (h.intdigest() >> 11) / float(1 << 53)

    def accepted(self, seq, drafts: list[int], sampled: list[int]) -> int:
        start = len(seq) - 1  # the index of the row's newest token (its placeholder)
        kept = 0
        while kept < len(drafts) and self._uniform(seq.seed, start + kept) < self.rates[min(kept, len(self.rates) - 1)]:
            kept += 1
        return kept
