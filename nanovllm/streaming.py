"""LLM.stream's increments, StreamOutputs (loaded, through wiring/, by the first stream or the
first that names `nanovllm.outputs.StreamOutput`: a plain generate never streams)."""

from __future__ import annotations

from typing import Iterator

from nanovllm.core.sequence import SequenceStatus
from nanovllm.outputs import CompletionOutput, RequestOutput


def _of_completion(name: str) -> property:
    """A read-only attribute of a StreamOutput: its completion's `name`."""
    return property(lambda self: getattr(self.outputs[0], name))


class StreamOutput(RequestOutput):
    """One increment of one completion while it is generated (`LLM.stream`), in the shape of
    vLLM's streamed RequestOutput with output_kind=DELTA: `outputs` holds the one completion the
    increment belongs to, with only what this step added (`text`, `token_ids`, `logprobs`);
    `cumulative_logprob`, `finish_reason` and `stop_reason` are its current values. `finished`
    is True once every completion of the request has ended.

    nano-vllm's StreamOutput fields stay: `index` (the prompt's position in the call's
    prompts), and `token_ids`, `text`, `finish_reason`, `stop_reason` as attributes reading the
    increment's completion (`outputs[0]`); `sample` is its completion index.
    """

    sample = _of_completion("index")
    text = _of_completion("text")
    token_ids = _of_completion("token_ids")
    finish_reason = _of_completion("finish_reason")
    stop_reason = _of_completion("stop_reason")
    logprobs = _of_completion("logprobs")

    def __init__(self, index: int, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 prompt_logprobs: list | None, completion: CompletionOutput, finished: bool,
                 num_cached_tokens: int | None = None):
        super().__init__(request_id, prompt, prompt_token_ids, prompt_logprobs, [completion], finished,
                         num_cached_tokens)
        self.index = index


def stream_outputs(llm, requests, adapters=None) -> Iterator[StreamOutput]:
    """The StreamOutputs of `llm`'s normalized (ids, params, text) requests as the engine makes
    them (`adapters`: each one's adapter id, or None); closing the iterator aborts the rest."""
    seqs = []
    with llm._exclusive():
        try:
            llm._clear_leftovers()
            llm._add_all(requests, seqs, track_text=True, adapters=adapters)
            yield from _increments(llm, seqs)
        finally:
            # Every finished increment handed out has already forgotten its text state.
            llm._release(seqs)


def _increments(llm, seqs: list) -> Iterator[StreamOutput]:
    where = {s.seq_id: (i, seq) for i, seq in enumerate(seqs) for s in seq.samples}
    first = set()  # requests whose first increment (with the prompt logprobs) went out
    # Not "until every request is finished": a request can finish (max_tokens) while its last
    # token is still on the device (overlap scheduling).
    while llm.has_unfinished():
        outputs, _, _ = llm.step()
        # A request is finished on its last increment only (with n > 1 several of its samples
        # may end in one step).
        last = {where[o.seq.seq_id][0]: j for j, o in enumerate(outputs)}
        for j, o in enumerate(outputs):
            i, seq = where[o.seq.seq_id]
            if o.finished:
                llm.forget_text(o.seq)  # its text went out in the increments
            cumulative, logprobs = llm._logprobs(o.seq, o.logprobs or (), o.new_token_ids)
            completion = CompletionOutput(o.seq.sample_index, o.text, o.new_token_ids, cumulative,
                                          logprobs, o.finish_reason, o.seq.stop_reason)
            prompt_logprobs = None
            if i not in first:
                first.add(i)
                prompt_logprobs = llm._prompt_logprobs(seq)
            done = last[i] == j and all(s.status == SequenceStatus.FINISHED for s in seq.samples)
            yield StreamOutput(i, seq.request_id, seq.prompt_text, seq.prompt_token_ids,
                               prompt_logprobs, completion, done, seq.num_cached_prompt_tokens or 0)
