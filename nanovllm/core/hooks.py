"""The hooks the core declares: small typed protocols that features implement and the fronts
(`llm.py`, `serve/`) plug in when an option or a request asks for them.

The core calls these protocols and never names a feature: a plain generate with no options runs
the core alone. One section per hook; each feature module says which hook it plugs into.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable  # noqa: F401

# ---------------------------------------------------------------- logits (sampling extensions)

# ---------------------------------------------------------------- scheduling

# ---------------------------------------------------------------- forward strategy (graphs)


class ForwardStrategy(Protocol):
    """Another way than the eager forward to run a prefill-shaped step (piecewise CUDA graphs:
    features/prefill_graphs.py). The model runner asks it about every prefill step, and runs the
    step eagerly when it declines."""

    max_prefill_tokens: int  # the largest step it may run (the KV budget charges its memory first)

    def prepare(self, runner) -> bool:
        """Get ready (capture) on `runner` (a ModelRunner with its model, KV cache and decode
        graphs); False when it cannot serve this model (the runner then runs eagerly)."""

    def runs_prefill(self, num_tokens: int) -> bool:
        """Whether it runs a prefill step of `num_tokens` tokens."""

    def run_prefill(self, ids, positions, meta):
        """The final hidden states [num_tokens, hidden] of the step, as model(ids, positions, meta)."""
