"""nano-vllm: a small, readable and fast offline LLM inference engine."""

from nanovllm.llm import LLM
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput, StreamOutput
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "StreamOutput"]
