"""What only a front API runs (data-parallel LLM, chat, stream, step API, beam search, prompt
dicts, logprobs in vLLM's form, LLM's occasional calls): nanovllm/wiring/'s __getattr__ serves
these loaders, so `wiring.chat_requests(...)` loads this module, then chat_template.py, at the
first chat."""

from __future__ import annotations


def data_parallel_llm(llm_class: type) -> type:
    """The front of LLM(..., data_parallel_size=N) (or the Ray backend): data_parallel_front.py's
    DataParallelLLM over `llm_class`, whose executor is launch/data_parallel.py's ReplicaSet."""
    from nanovllm.data_parallel_front import data_parallel_llm as front

    return front(llm_class)


def logprob_dicts(llm, entries, tokens, params) -> list:
    """A request's logprobs in vLLM's form (logprob_outputs.py, loaded by the first that has some)."""
    from nanovllm.logprob_outputs import logprob_dicts as dicts

    return dicts(llm, entries, tokens, params)


def llm_calls():
    """llm_calls.py: what LLM's calls need only at times (a progress bar, a call cut short)."""
    import nanovllm.llm_calls as calls

    return calls


def beam_search(llm, prompts, params, lora_request):
    """LLM.beam_search: features/beam_search.py, loaded at its first use."""
    from nanovllm.features.beam_search import beam_search as search

    return search(llm, prompts, params, lora_request)


def dict_prompt(llm, prompt: dict) -> tuple[list[int], str | None]:
    """LLM's reading of vLLM's prompt dicts (inputs.py, loaded at the first one)."""
    from nanovllm.inputs import dict_prompt as read

    return read(llm, prompt)


def stream(llm, requests, adapters):
    """LLM.stream's iterator over normalized requests (streaming.py, loaded at the first stream)."""
    from nanovllm.streaming import stream_outputs

    return stream_outputs(llm, requests, adapters)


def chat_requests(llm, messages, sampling_params, options: dict, mm_processor_kwargs=None) -> list:
    """LLM.chat's checked requests (chat_template.py, loaded at the first chat)."""
    from nanovllm.chat_template import ChatOptions, chat_requests as requests

    return requests(llm, messages, sampling_params, ChatOptions(**options), mm_processor_kwargs)


def chat_prompt_ids(front, messages, chat_template_kwargs: dict) -> list[int]:
    """LLM.chat_prompt_ids (chat_template.py): the server's rendering of a conversation."""
    from nanovllm.chat_template import chat_prompt_ids as prompt_ids

    return prompt_ids(front, messages, chat_template_kwargs)


def step_api(llm):
    """LLM.llm_engine: vLLM's step API over `llm` (llm_engine.py), loaded at its first use."""
    from nanovllm.llm_engine import LLMEngine

    return LLMEngine(llm)
