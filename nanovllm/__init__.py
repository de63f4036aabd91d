"""nano-vllm: a small, readable and fast offline LLM inference engine."""

from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput, StreamOutput
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "StreamOutput"]


def __getattr__(name):
    # Imported lazily so that `import nanovllm.kernels` (tests, tools) does not pull in the
    # whole engine and its heavy dependencies.
    if name == "LLM":
        from nanovllm.llm import LLM

        return LLM
    raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
