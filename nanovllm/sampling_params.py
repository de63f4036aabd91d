"""Per-request generation settings (vLLM-compatible names)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field


def is_integer(x) -> bool:
    """An integer as callers pass them: int or numpy's integers, but not bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x) -> bool:
    """A real number (int, float, numpy's), not bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    temperature: 0 means greedy; otherwise logits are divided by it before sampling.
    top_p: keep the smallest set of tokens whose probability mass reaches top_p (1 = off).
    top_k: keep the k most likely tokens (-1 or 0 = off).
    min_p: drop tokens whose probability is below min_p times the top token's (0 = off).
    max_tokens: the most tokens to generate (>= 1).
    min_tokens: EOS and `stop_token_ids` are suppressed until this many tokens exist.
    ignore_eos: keep generating after EOS (benchmarks).
    stop: strings that end generation when they appear in the output text; the stop string
        itself is left out of the returned text.
    stop_token_ids: extra token ids that end generation (kept in `token_ids`).
    seed: per-request seed: the same request gives the same tokens whatever else is batched
        with it. Without it, the engine's seed makes whole runs reproducible.

    Instances are immutable (use dataclasses.replace to derive a variant). Stop strings are
    matched from the first generated token on, also before min_tokens is reached.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 64
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    # Normalised forms of `stop` / `stop_token_ids`, filled in by __post_init__.
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())
    stop_ids: frozenset[int] = field(init=False, repr=False, default=frozenset())

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        is_int, is_num = is_integer, is_real
        if not is_num(self.temperature) or not (self.temperature >= 0.0) or self.temperature == float("inf"):
            bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if self.temperature != 0 and self.temperature < 1e-5:
            bad("temperature", "must be 0 (greedy) or >= 1e-5; smaller values overflow the logits")
        if not is_num(self.top_p) or not (0.0 < self.top_p <= 1.0):
            bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or (self.top_k < 0 and self.top_k != -1):
            bad("top_k", "must be -1 (off), 0 (off) or a positive integer")
        if not is_num(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            bad("min_p", "must be in [0, 1]")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be a bool")
        if self.seed is not None and not is_int(self.seed):
            bad("seed", "must be an integer or None")

        stop = self.stop
        if stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stops = (stop,)
        elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            stops = tuple(stop)
        else:
            bad("stop", "must be a string, a list of strings or None")
        if any(s == "" for s in stops):
            bad("stop", "stop strings must not be empty")
        ids = self.stop_token_ids
        if ids is None:
            ids = []
        if not isinstance(ids, (list, tuple, set, frozenset)) or not all(is_int(t) and t >= 0 for t in ids):
            bad("stop_token_ids", "must be a list of non-negative integers or None")
        # Frozen: validated once, so nobody can make a checked instance invalid afterwards.
        # Numbers are stored as Python's own (numpy's would reach the sampler's tensors).
        for name, kind in (("temperature", float), ("top_p", float), ("top_k", int), ("min_p", float),
                           ("max_tokens", int), ("min_tokens", int)):
            object.__setattr__(self, name, kind(getattr(self, name)))
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))
        object.__setattr__(self, "stop_strings", stops)
        object.__setattr__(self, "stop_ids", frozenset(int(t) for t in ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
