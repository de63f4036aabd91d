"""Logits extensions: per-request changes of the logits before the draw and logprobs after it,
one module per feature, each plugging into a hook of core/hooks.py (logits section); processing.py
holds them on the sampler and runs them in its draw."""
