"""`LLM`: the front object users create (vLLM-compatible names)."""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import TYPE_CHECKING, Iterator

import nanovllm.wiring as wiring
from nanovllm.config import wants_data_parallel
from nanovllm.core.engine import LLMEngine
from nanovllm.core.interrupts import deferred_interrupts
from nanovllm.core.sequence import Sequence
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanovllm.streaming import StreamOutput

__all__ = ["LLM"]


class LLM(LLMEngine):
    """An offline engine for one model (README: every keyword argument). generate() returns vLLM's
    RequestOutputs, which also read as nano-vllm's dicts: `out.outputs[0].text == out["text"]`."""

    def __new__(cls, *args, **kwargs):
        """With data_parallel_size > 1 (or the Ray backend), a DataParallelLLM (data_parallel_front.py)."""
        if cls is LLM and wants_data_parallel(kwargs):
            cls = wiring.data_parallel_llm(LLM)
        return super().__new__(cls)

    def __init__(self, model: str, **kwargs):
        self._busy = threading.Lock()  # held by a generate / stream / chat: see _exclusive
        self._token_texts: dict[int, str] = {}  # Logprob.decoded_token, by token id
        self._call_seqs: list[Sequence] = []  # the requests of the latest generate / stream
        self._stats_recorder = None
        self.lora_registry: dict = {}  # adapter id -> LoRARequest (enable_lora)
        super().__init__(model, start_executor=self._start_executor, model_features=wiring, **kwargs)
        wiring.wire_scheduling(self)  # mixed steps, when asked
        self._stats_recorder = wiring.stats_recorder(self)  # disable_log_stats=False

    def _start_executor(self, config):
        """What runs the model: this process, or tensor-parallel workers / torchrun (wiring/)."""
        return wiring.start_executor(config)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # ------------------------------------------------------------------ inputs
    def _normalize(self, prompts, sampling_params):
        """Check every prompt and parameter before any work starts: (ids, validated params, text) triples."""
        if isinstance(prompts, list) and all(isinstance(p, str) for p in prompts) and \
                isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:  # one prompt, token ids, prompt dicts, default or per-prompt params (llm_calls.py)
            prompts, params = wiring.llm_calls().prompts_and_params(self, prompts, sampling_params)
        requests, prepared = [], {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                ids, text = self._prompt(prompt)
                if p.max_tokens is None:  # up to max_model_len: this prompt's own
                    snap = self.prepare_for_prompt(p, len(ids))
                else:
                    if id(p) not in prepared:
                        prepared[id(p)] = self.prepare_params(p)
                    snap = prepared[id(p)]
                self.check_fits(len(ids), snap)
            except (ValueError, TypeError, NotImplementedError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
            requests.append((ids, snap, text))
        return requests

    def _prompt(self, prompt) -> tuple[list[int], str | None]:
        """(token ids, text or None) of a text, token-id or dict prompt (inputs.py)."""
        if isinstance(prompt, dict):
            return wiring.dict_prompt(self, prompt)
        return self.tokenize(prompt), prompt if isinstance(prompt, str) else None

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, sampling_params=None, use_tqdm=True, lora_request=None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order (docs/api.md); use_tqdm may be vLLM's bar-making callable."""
        requests = self._normalize(prompts, sampling_params)
        return self._run_requests(requests, use_tqdm, wiring.lora_adapters(self, lora_request, len(requests)))

    def _run_requests(self, requests, use_tqdm, adapters=None) -> list[RequestOutput]:
        """The outputs of normalized requests, run to completion (`adapters`: each one's adapter id)."""
        seqs = []
        # A signal handler's exception (Ctrl-C, a timeout) comes out at a step's end; the clean-up runs uncut.
        with self._exclusive(), deferred_interrupts():
            try:
                self._clear_leftovers()
                self._add_all(requests, seqs, adapters=adapters)
                self._run_to_completion(sum(len(s.samples) for s in seqs), use_tqdm)
            except BaseException:
                self._release(seqs)
                raise
            outputs = [self._request_output(seq) for seq in seqs]
            self._call_seqs = []
            return outputs

    def prepare_params(self, params: SamplingParams) -> SamplingParams:
        p = super().prepare_params(params)
        wiring.tokenize_bad_words(self, p)
        wiring.enable_structured_outputs(self, p)  # the constraint compiled (and checked) up front
        return p

    def add_request(self, prompt_ids: list[int], params: SamplingParams, track_text: bool = False,
                    prompt: str | None = None, adapter: int = 0) -> Sequence:
        params = params if getattr(params, "_frozen", False) else \
            self.prepare_for_prompt(params, len(prompt_ids))
        # The features the request asks for, on first use.
        wiring.wire_scheduling(self, params)
        wiring.enable_logits_extensions(self.model_runner.sampler, params)
        wiring.enable_structured_outputs(self, params)  # (compiled already, but in a data-parallel replica)
        wiring.enable_text_tracking(self.requests, params, track_text)
        seq = super().add_request(prompt_ids, params, track_text, prompt, adapter)
        if self._stats_recorder is not None:
            self._stats_recorder.arrived(seq)
        return seq

    def step(self):
        result = super().step()
        if self._stats_recorder is not None:
            self._stats_recorder.observe(result.outputs)
        return result

    def get_metrics(self) -> list:
        """vLLM's: the engine's metrics since it started (needs disable_log_stats=False; llm_calls.py)."""
        return wiring.llm_calls().metrics(self)

    def _add_all(self, requests, seqs: list, track_text: bool = False, adapters=None) -> None:
        """Queue every request into `seqs`; a Ctrl-C lands after the last one, never in between (a leak)."""
        with deferred_interrupts():
            self._call_seqs = seqs
            for i, (ids, p, text) in enumerate(requests):
                seqs.append(self.add_request(ids, p, track_text=track_text, prompt=text,
                                             adapter=adapters[i] if adapters else 0))

    def _release(self, seqs) -> None:
        """A generate / stream ended early (or a stream ended): end its requests (llm_calls.py)."""
        wiring.llm_calls().release_call(self, seqs)

    def _clear_leftovers(self) -> None:
        """End the previous call's requests if an exception cut its clean-up short."""
        if self._call_seqs:
            self._release(self._call_seqs)

    @contextlib.contextmanager
    def _exclusive(self):
        """One generate / stream at a time (a second caller would swallow the first one's outputs)."""
        claimed = False
        try:
            with deferred_interrupts():
                claimed = self._busy.acquire(blocking=False)
            if not claimed:
                raise wiring.llm_calls().busy_error()
            yield
        finally:
            if claimed:
                self._busy.release()

    # ------------------------------------------------------------------ outputs
    def _request_output(self, seq: Sequence) -> RequestOutput:
        completions = [CompletionOutput(s.sample_index, self.final_text(s), s.completion_token_ids,
                                        *self._logprobs(s, s.logprobs, s.completion_token_ids),
                                        s.finish_reason, s.stop_reason)
                       for s in seq.samples]
        return RequestOutput(seq.request_id, seq.prompt_text, seq.prompt_token_ids, self._prompt_logprobs(seq),
                             completions, all(s.finish_reason is not None for s in seq.samples),
                             seq.num_cached_prompt_tokens or 0, self.request_metrics(seq))

    def _logprobs(self, seq: Sequence, entries, tokens) -> tuple[float | None, list | None]:
        """(cumulative_logprob, logprobs) of a completion in vLLM's form, or (None, None)."""
        if seq.logprobs is None:
            return None, None
        return seq.cumulative_logprob, wiring.logprob_dicts(self, entries, tokens, seq.params)

    def _prompt_logprobs(self, seq: Sequence) -> list | None:
        """vLLM's prompt_logprobs of a request: None for the first token, then as _logprobs'."""
        if seq.prompt_logprobs is None:
            return None
        return [None] + wiring.logprob_dicts(self, seq.prompt_logprobs, seq.prompt_token_ids[1:], seq.params)

    def request_metrics(self, seq: Sequence):
        """A finished request's RequestMetrics (nanovllm/metrics.py) with statistics on, else None."""
        return None if self._stats_recorder is None else self._stats_recorder.request_metrics(seq)

    def _run_to_completion(self, total: int, use_tqdm) -> None:
        """Step until every request has ended (a progress bar over `total` completions: llm_calls.py)."""
        if use_tqdm:
            return wiring.llm_calls().run_with_progress_bar(self, total, use_tqdm)
        while self.has_unfinished():
            self.step()

    def stream(self, prompts, sampling_params=None, lora_request=None) -> Iterator[StreamOutput]:
        """A StreamOutput per completion increment (streaming.py). Bad input raises here; the requests
        start when iteration does, and closing the iterator early aborts them."""
        requests = self._normalize(prompts, sampling_params)
        return wiring.stream(self, requests, wiring.lora_adapters(self, lora_request, len(requests)))

    def chat(self, messages, sampling_params=None, use_tqdm=True, lora_request=None, chat_template=None,
             chat_template_content_format="auto", add_generation_prompt=True, continue_final_message=False,
             tools=None, documents=None, chat_template_kwargs=None, mm_processor_kwargs=None,
             **template_kwargs) -> list[RequestOutput]:
        """vLLM's: replies to one conversation or a list of them, through the chat template (chat_template.py)."""
        options = dict(template=chat_template, content_format=chat_template_content_format,
                       add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                       tools=tools, documents=documents,
                       kwargs=wiring.llm_calls().template_kwargs(chat_template_kwargs, template_kwargs))
        requests = wiring.chat_requests(self, messages, sampling_params, options, mm_processor_kwargs)
        return self._run_requests(requests, use_tqdm, wiring.lora_adapters(self, lora_request, len(requests)))

    @functools.cached_property
    def llm_engine(self):
        """vLLM's step API over this LLM (llm_engine.py), made at first use."""
        return wiring.step_api(self)

    def beam_search(self, prompts, params, lora_request=None, use_tqdm=False, concurrency_limit=None) -> list:
        """vLLM's: the `params.beam_width` best continuations of each prompt (features/beam_search.py)."""
        return wiring.beam_search(self, prompts, params, lora_request)

    def chat_prompt_ids(self, messages, **chat_template_kwargs) -> list[int]:
        """The prompt tokens chat() generates from for one conversation: what the server renders."""
        return wiring.chat_prompt_ids(self, messages, chat_template_kwargs)
