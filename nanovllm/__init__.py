"""nano-vllm: a small, readable and fast offline LLM inference engine."""

from nanovllm.llm import LLM
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.wiring import late

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "StreamOutput"]

# Loaded when first named (a plain generate uses none): vLLM's EngineArgs and step API, outputs.py's late types.
_LATE = {"EngineArgs": late("nanovllm.engine_args", "EngineArgs"), "Logprob": late("nanovllm.outputs", "Logprob"),
         "LLMEngine": late("nanovllm.llm_engine", "LLMEngine"),
         "StreamOutput": late("nanovllm.outputs", "StreamOutput")}


def __getattr__(name: str):
    if name not in _LATE:
        raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
    return _LATE[name]()
