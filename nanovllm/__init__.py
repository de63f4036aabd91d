"""nano-vllm: a small, readable and fast offline LLM inference engine."""

import nanovllm.wiring as _wiring
from nanovllm.engine_args import EngineArgs
from nanovllm.llm import LLM
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput, StreamOutput
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "StreamOutput"]


def __getattr__(name: str):
    """LLMEngine (vLLM's step API) loads when first named: a plain generate does not use it."""
    return _wiring.package_attribute(name)
