"""vLLM's parameter classes that live beside SamplingParams in `vllm.sampling_params`, so that
scripts import them from `nanovllm.sampling_params` as they do from vLLM (which loads this module
at the first that names one: a plain request does not)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BeamSearchParams:
    """vLLM's beam-search parameters (LLM.beam_search)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False


@dataclass
class StructuredOutputsParams:
    """vLLM's constraints on a request's output (SamplingParams.structured_outputs): one of a
    JSON schema (dict or JSON text), a regex, a list of choices, an EBNF grammar, any JSON
    object, or an xgrammar structural tag (features/structured/). disable_any_whitespace: JSON
    without free whitespace between tokens. The other fields are vLLM's, accepted as given."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # The tag ending the reasoning, after which the constraint applies (the server's --reasoning-parser)
    _reasoning_end: str | None = field(default=None, init=False, repr=False)
