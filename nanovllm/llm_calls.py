"""What LLM's calls need only at times (loaded through wiring/, so a plain generate without a
progress bar loads none of it): the progress bar, the clean-up of a call cut short, the prompts
and parameters of any but a list of text prompts with one SamplingParams, chat() and get_metrics()."""

from __future__ import annotations

import time

from nanovllm.core.interrupts import deferred_interrupts
from nanovllm.sampling_params import SamplingParams, is_integer


def progress_bar(use_tqdm, total: int):
    """The generate() progress bar over `total` completions, or None without one."""
    if not use_tqdm:
        return None
    if not callable(use_tqdm):  # as in vLLM, it may be a callable that makes the bar (tqdm's keywords)
        from tqdm.auto import tqdm as use_tqdm
    return use_tqdm(total=total, desc="Generating", dynamic_ncols=True)


def run_with_progress_bar(llm, total: int, use_tqdm) -> None:
    """Step `llm` until every request has ended, the bar showing prefill and decode tok/s."""
    bar = progress_bar(use_tqdm, total)
    try:
        prefill_tps = decode_tps = 0.0
        while llm.has_unfinished():
            t = time.perf_counter()
            outputs, num_tokens, is_prefill = llm.step()
            dt = max(time.perf_counter() - t, 1e-9)
            if is_prefill:
                prefill_tps = num_tokens / dt
            else:
                decode_tps = num_tokens / dt
            bar.set_postfix(prefill=f"{prefill_tps:.0f}tok/s", decode=f"{decode_tps:.0f}tok/s")
            bar.update(sum(o.finished for o in outputs))
    finally:
        bar.close()


def release_call(llm, seqs) -> None:
    """A generate / stream ended early: abort its unfinished requests, the launched step and
    every request's text state (nobody will read it). A second Ctrl-C waits until this is done."""
    with deferred_interrupts():
        for seq in seqs:
            for sample in seq.samples:
                llm.abort(sample)
        llm.cancel_in_flight()
        for seq in seqs:
            for sample in seq.samples:
                llm.forget_text(sample)
            llm.request_metrics(seq)  # (statistics on: drop its times)
        llm._call_seqs = []


def prompts_and_params(llm, prompts, sampling_params) -> tuple[list, list[SamplingParams]]:
    """generate() / stream()'s prompts as a list, with one SamplingParams each (checked)."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    elif isinstance(prompts, (list, tuple)) and prompts and all(is_integer(t) for t in prompts):
        prompts = [list(prompts)]  # one prompt given as token ids
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a str, a list of str, a list of token-id lists or "
                        f"{{'prompt': ...}} / {{'prompt_token_ids': ...}} dicts, got {type(prompts).__name__}")
    if sampling_params is None:
        sampling_params = llm.get_default_sampling_params()
    params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else sampling_params
    if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
        raise TypeError(f"sampling_params must be SamplingParams or a list of SamplingParams, "
                        f"got {type(sampling_params).__name__}")
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; "
                         f"pass one for all or exactly one per prompt")
    return prompts, params


def template_kwargs(chat_template_kwargs, template_kwargs: dict) -> dict:
    """LLM.chat's template variables: `chat_template_kwargs` (checked), then chat()'s other keywords."""
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise TypeError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
    return {**(chat_template_kwargs or {}), **template_kwargs}


def metrics(llm) -> list:
    """LLM.get_metrics: vLLM's counters, gauges and histograms (metrics.py) under the server's names."""
    if llm._stats_recorder is None:
        raise RuntimeError("statistics are off: create the LLM with disable_log_stats=False to read get_metrics()")
    return llm._stats_recorder.metrics()


def busy_error() -> RuntimeError:
    """What a generate / stream / chat gets while another call of its LLM runs (LLM._exclusive)."""
    return RuntimeError("this LLM is already generating (an open stream() iterator, another thread, a server's "
                        "engine loop): finish or close that call first, or give each thread its own LLM")
