"""nano-vllm: a small, readable and fast offline LLM inference engine."""

import nanovllm.outputs as _outputs
import nanovllm.wiring as _wiring
from nanovllm.engine_args import EngineArgs
from nanovllm.llm import LLM
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "StreamOutput"]


def __getattr__(name: str):
    """LLMEngine (vLLM's step API), Logprob and StreamOutput load when first named: a plain
    generate does not use them."""
    if name in ("Logprob", "StreamOutput"):
        return getattr(_outputs, name)
    return _wiring.package_attribute(name)
