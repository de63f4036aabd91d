"""Structured outputs (SamplingParams.structured_outputs): the constraint compiled into a grammar
with xgrammar (`grammars.py`), and the per-step token mask that keeps each constrained row's
output inside it (`masks.py`, a LogitsExtension of core/hooks.py)."""
