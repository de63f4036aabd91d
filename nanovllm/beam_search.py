"""vLLM's import path of beam search's outputs (`vllm.beam_search`); the search itself is
features/beam_search.py, which `LLM.beam_search` runs."""

from nanovllm.features.beam_search import BeamSearchOutput, BeamSearchSequence  # noqa: F401
