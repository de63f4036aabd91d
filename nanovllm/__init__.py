"""nano-vllm: a small, readable and fast offline LLM inference engine."""

from nanovllm.engine_args import EngineArgs
from nanovllm.llm import LLM
from nanovllm.llm_engine import LLMEngine
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput, StreamOutput
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "StreamOutput"]
