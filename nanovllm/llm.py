"""`LLM`: the front object users create (vLLM-compatible names)."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Iterator

from nanovllm.engine.interrupts import deferred_interrupts
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams, is_integer


@dataclass
class StreamOutput:
    """One increment of one request while it is generated (`LLM.stream`).

    index: position of the request in the prompts given; token_ids / text: what this step added
    (text is empty until it is stable: an incomplete UTF-8 character or a possible stop string
    is held back); finished / finish_reason: set on the request's last increment.
    """

    index: int
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None


class LLM(LLMEngine):
    """An offline engine for one model. See README for every keyword argument.

    >>> llm = LLM("/path/to/Qwen3-0.6B")
    >>> llm.generate(["Hello"], SamplingParams(temperature=0.6, max_tokens=32))
    [{'text': ..., 'token_ids': [...], 'finish_reason': 'length', ...}]
    """

    def __init__(self, model: str, **kwargs):
        # Taken by generate / stream / chat, so that a second caller (another thread, or an open
        # stream() iterator) gets a clear error instead of sharing the engine's steps.
        self._busy = threading.Lock()
        super().__init__(model, **kwargs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # ------------------------------------------------------------------ inputs
    def _normalize(self, prompts, sampling_params):
        """Validate every prompt and parameter before any work starts; returns (ids, params) pairs."""
        if isinstance(prompts, str):
            prompts = [prompts]
        elif isinstance(prompts, (list, tuple)) and prompts and all(is_integer(t) for t in prompts):
            prompts = [list(prompts)]  # one prompt given as token ids
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a str, a list of str or a list of token-id lists, "
                            f"got {type(prompts).__name__}")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts; "
                                 f"pass one for all or exactly one per prompt")
            if not all(isinstance(p, SamplingParams) for p in sampling_params):
                raise TypeError("sampling_params must be SamplingParams objects")
            params = list(sampling_params)
        else:
            raise TypeError(f"sampling_params must be SamplingParams or a list of them, "
                            f"got {type(sampling_params).__name__}")
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                ids = self.tokenize(prompt)
                self.check_fits(len(ids), p)
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
            requests.append((ids, p))
        return requests

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[dict]:
        """Generate for every prompt; one dict per prompt, in input order:
        {"text", "token_ids", "finish_reason", "prompt_token_ids"}."""
        requests = self._normalize(prompts, sampling_params)
        seqs = []
        with self._exclusive():
            try:
                self._add_all(requests, seqs)
                self._run_to_completion(len(seqs), use_tqdm)
            except BaseException:
                self._release(seqs)
                raise
        return [self._result(seq) for seq in seqs]

    def _add_all(self, requests, seqs: list, track_text: bool = False) -> None:
        """Queue every request, appending its Sequence to `seqs`: a Ctrl-C lands after the last
        one, never between queuing a request and recording it (which would leak it)."""
        with deferred_interrupts():
            for ids, p in requests:
                seqs.append(self.add_request(ids, p, track_text=track_text))

    def _release(self, seqs) -> None:
        """A generate / stream ended early: abort its unfinished requests, the launched step and
        every request's text state (nobody will read it). A second Ctrl-C waits until this is done."""
        with deferred_interrupts():
            for seq in seqs:
                self.abort(seq)
            self.cancel_in_flight()
            for seq in seqs:
                self.forget_text(seq)

    @contextlib.contextmanager
    def _exclusive(self):
        """One generate / stream at a time: steps run every queued request, so a second caller
        would swallow the first one's outputs. The check and the claim are one atomic step."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this LLM is already generating (an open stream() iterator, or a call from "
                               "another thread); an LLM serves one generate/stream/chat at a time: finish "
                               "or close the other one first, or give each thread its own LLM")
        try:
            yield
        finally:
            self._busy.release()

    def _result(self, seq) -> dict:
        return {"text": self.final_text(seq), "token_ids": seq.completion_token_ids,
                "finish_reason": seq.finish_reason, "prompt_token_ids": seq.prompt_token_ids}

    def _run_to_completion(self, total: int, use_tqdm: bool) -> None:
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc="Generating", dynamic_ncols=True)
        prefill_tps = decode_tps = 0.0
        while self.has_unfinished():
            t = time.perf_counter()
            outputs, num_tokens, is_prefill = self.step()
            if bar is not None:
                dt = max(time.perf_counter() - t, 1e-9)
                if is_prefill:
                    prefill_tps = num_tokens / dt
                else:
                    decode_tps = num_tokens / dt
                bar.set_postfix(prefill=f"{prefill_tps:.0f}tok/s", decode=f"{decode_tps:.0f}tok/s")
                bar.update(sum(o.finished for o in outputs))
        if bar is not None:
            bar.close()

    def stream(self, prompts, sampling_params=None) -> Iterator[StreamOutput]:
        """Yield per-request increments as the engine produces them.

        Concatenating a request's `text` increments gives exactly the `text` that `generate`
        returns; stop strings are never shown partially. Bad input raises here, at the call;
        the requests start when iteration starts, and closing the iterator early aborts them.
        """
        requests = self._normalize(prompts, sampling_params)
        return self._stream(requests)

    def _stream(self, requests) -> Iterator[StreamOutput]:
        seqs = []
        with self._exclusive():
            try:
                self._add_all(requests, seqs, track_text=True)
                index = {seq.seq_id: i for i, seq in enumerate(seqs)}
                # Not "until every request is finished": a request can finish (max_tokens) while
                # its last token is still on the device (overlap scheduling).
                while self.has_unfinished():
                    outputs, _, _ = self.step()
                    for o in outputs:
                        if o.finished:
                            self.final_text(o.seq)  # forget its detokenizer
                        yield StreamOutput(index[o.seq.seq_id], o.new_token_ids, o.text, o.finished,
                                           o.finish_reason)
            finally:
                # Every finished increment handed out has already forgotten its text state.
                self._release(seqs)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, **chat_template_kwargs) -> list[dict]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or to a list of
        conversations, through the tokenizer's chat template. Extra keyword arguments go to the
        template (e.g. Qwen3's `enable_thinking=False`); one the template never reads is an
        error, not silently ignored."""
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer (skip_tokenizer_init=True was given)")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError("messages must be a non-empty list of {'role', 'content'} dicts or of such lists")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        for i, conv in enumerate(conversations):
            _check_conversation(conv, f"conversation {i}" if len(conversations) > 1 else "messages")
        self._check_chat_template_kwargs(chat_template_kwargs)
        prompts = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True,
                                                      **chat_template_kwargs)
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _check_chat_template_kwargs(self, kwargs: dict) -> None:
        """A TypeError for keywords chat() sets itself, and for ones the chat template never
        reads (Jinja would ignore a misspelt `enable_thinkng` or `sampling_param` silently)."""
        taken = sorted(_CHAT_FIXED_KWARGS & kwargs.keys())
        if taken:
            raise TypeError(f"chat() got {', '.join(taken)}: it renders the template as text with the "
                            "generation prompt itself")
        template = self.tokenizer.chat_template
        given = kwargs.get("chat_template")  # a template's text, or the name of one of the tokenizer's
        if given is not None:
            template = template[given] if isinstance(template, dict) and given in template else given
        used = _template_variables(template)
        if used is None:
            return  # no template, or one this check cannot parse: apply_chat_template decides
        unknown = sorted(k for k in kwargs if k not in used and k != "chat_template")
        if unknown:
            options = sorted(used - _CHAT_TEMPLATE_BUILTINS)
            raise TypeError(f"chat() got keyword arguments the chat template does not use: {', '.join(unknown)} "
                            f"(template variables: {', '.join(options) or 'none'})")


_CHAT_ROLES = ("system", "user", "assistant", "tool")
# apply_chat_template arguments that chat() fixes (text out, generation prompt on).
_CHAT_FIXED_KWARGS = frozenset({"conversation", "tokenize", "add_generation_prompt", "continue_final_message",
                                "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding",
                                "truncation", "max_length"})
# Names every template sees from transformers, not options a caller would pass.
_CHAT_TEMPLATE_BUILTINS = frozenset({"messages", "add_generation_prompt", "raise_exception", "strftime_now",
                                     "bos_token", "eos_token", "unk_token", "pad_token"})


def _check_conversation(conv, where: str) -> None:
    """A clear error for a message the template would mangle or drop without a word (a
    missing or non-text content renders as empty, an unknown role vanishes in Qwen3's)."""
    if not isinstance(conv, (list, tuple)) or not conv:
        raise TypeError(f"{where} must be a non-empty list of {{'role', 'content'}} dicts")
    for j, m in enumerate(conv):
        if not isinstance(m, dict):
            raise TypeError(f"{where}, message {j}: must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in _CHAT_ROLES:
            raise ValueError(f"{where}, message {j}: role must be one of {', '.join(_CHAT_ROLES)}, got {role!r}")
        content = m.get("content")
        calls_tools = role == "assistant" and bool(m.get("tool_calls"))
        if not isinstance(content, str) and not (calls_tools and content is None):
            raise TypeError(f"{where}, message {j}: content must be a string, got {type(content).__name__}")


def _template_variables(template) -> set[str] | None:
    """The variables a Jinja chat template reads (over all of them if the tokenizer has several
    named ones), or None when there is no template or it does not parse here."""
    if template is None:
        return None
    templates = template.values() if isinstance(template, dict) else [template]
    try:
        from jinja2 import Environment, meta

        env = Environment(extensions=["jinja2.ext.loopcontrols"])
        return set().union(*(meta.find_undeclared_variables(env.parse(t)) for t in templates))
    except Exception:  # a template using transformers' own tags, say: no check rather than a false alarm
        return None
