"""vLLM's `LLMEngine` step API over an `LLM`: `add_request(request_id, prompt, params)`, `step()`
returning RequestOutputs, `has_unfinished_requests()`, `abort_request(ids)`. `LLM.llm_engine`
returns one; `LLMEngine.from_engine_args(EngineArgs(...))` makes one with its own LLM.

Each step returns an output for every request it advanced, as its SamplingParams' output_kind
asks: CUMULATIVE (vLLM's default) everything so far, DELTA only what the step added, FINAL_ONLY
one output when the request ends. Requests added here run beside nothing else: a generate()
meanwhile would run them too, so drive one LLM either way at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanovllm.core.sequence import Sequence, SequenceStatus
from nanovllm.lora.request import check_no_lora
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class _Request:
    """A request of the step API: its Sequence (sample 0) and, per sample,
    its tokens, text and logprob entries so far, and how much of them DELTA outputs have sent
    (the engine streams text: track_text)."""

    seq: Sequence
    tokens: list[list[int]]  # resolved tokens (the Sequence's last one may still be on the device)
    texts: list[str]
    logprobs: list[list]
    sent: list[tuple[int, int, int]]  # (tokens, logprob entries, characters) sent per sample
    sent_prompt_logprobs: bool = False

    @classmethod
    def of(cls, seq: Sequence, n: int) -> "_Request":
        return cls(seq, [[] for _ in range(n)], [""] * n, [[] for _ in range(n)], [(0, 0, 0)] * n)


class LLMEngine:
    """vLLM's LLMEngine (see the module docstring) over `llm`, an LLM (llm.py loads this module
    at the first LLM.llm_engine, through wiring/: it does not import llm.py back)."""

    def __init__(self, llm):
        self.llm = llm
        self._requests: dict[str, _Request] = {}
        self._ids: dict[int, str] = {}  # seq id of every sample -> its request id

    @classmethod
    def from_engine_args(cls, engine_args) -> "LLMEngine":
        """The step API over a new LLM made from `engine_args` (an EngineArgs)."""
        return cls(engine_args.create_llm())

    def get_tokenizer(self):
        return self.llm.get_tokenizer()

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, arrival_time=None,
                    lora_request=None, **_unused) -> None:
        """Queue `prompt` (text, token ids or a prompt dict) under the caller's `request_id`,
        checked as generate() checks it (a ValueError / TypeError before anything is queued)."""
        check_no_lora(lora_request)
        request_id = str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        (ids, p, text), = self.llm._normalize([prompt], params)
        seq = self.llm.add_request(ids, p, track_text=True, prompt=text)
        seq.request_id = request_id
        self._requests[request_id] = _Request.of(seq, p.n)
        self._ids.update((sample.seq_id, request_id) for sample in seq.samples)

    def has_unfinished_requests(self) -> bool:
        return self.llm.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def abort_request(self, request_id) -> None:
        """Abort one request id or an iterable of them; unknown or finished ids are ignored (vLLM's)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in map(str, ids):
            req = self._requests.get(rid)
            if req is not None:
                for sample in req.seq.samples:
                    self.llm.abort(sample)
                    self.llm.forget_text(sample)
                self.llm.request_metrics(req.seq)  # (statistics on: drop its times)
                self._forget(rid)

    def step(self) -> list[RequestOutput]:
        """One engine step: the outputs of the requests it advanced (see output_kind)."""
        results, _, _ = self.llm.step()
        touched: dict[str, None] = {}  # the requests the step advanced, in order
        for o in results:
            rid = self._ids.get(o.seq.seq_id)
            if rid is None:
                continue
            req = self._requests[rid]
            req.tokens[o.seq.sample_index] += o.new_token_ids
            req.texts[o.seq.sample_index] += o.text
            req.logprobs[o.seq.sample_index] += list(o.logprobs or ())
            touched[rid] = None
            if o.finished:
                self.llm.forget_text(o.seq)
        outputs = []
        for rid in touched:
            req = self._requests[rid]
            finished = all(s.status == SequenceStatus.FINISHED for s in req.seq.samples)
            if finished or req.seq.params.output_kind != RequestOutputKind.FINAL_ONLY:
                outputs.append(self._output(req, finished))
            if finished:
                self._forget(rid)
        return outputs

    def _forget(self, request_id: str) -> None:
        req = self._requests.pop(request_id)
        for sample in req.seq.samples:
            self._ids.pop(sample.seq_id, None)

    def _output(self, req: _Request, finished: bool) -> RequestOutput:
        seq = req.seq
        delta = seq.params.output_kind == RequestOutputKind.DELTA
        completions = []
        for s in seq.samples:
            i = s.sample_index
            tokens, entries, text = req.tokens[i], req.logprobs[i], req.texts[i]
            if delta:  # only what the steps since the last output added
                t, e, c = req.sent[i]
                req.sent[i] = (len(tokens), len(entries), len(text))
                tokens, entries, text = tokens[t:], entries[e:], text[c:]
            cumulative, logprobs = self.llm._logprobs(s, entries, tokens)
            completions.append(CompletionOutput(i, text, list(tokens), cumulative, logprobs, s.finish_reason,
                                                s.stop_reason))
        prompt_logprobs = None
        if not (delta and req.sent_prompt_logprobs):
            prompt_logprobs, req.sent_prompt_logprobs = self.llm._prompt_logprobs(seq), True
        return RequestOutput(seq.request_id, seq.prompt_text, seq.prompt_token_ids, prompt_logprobs, completions,
                             finished, seq.num_cached_prompt_tokens or 0,
                             self.llm.request_metrics(seq) if finished else None)

