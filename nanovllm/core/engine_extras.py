"""What LLMEngine (core/engine.py) runs only at times, loaded at first use through its EXTRAS slot
(filled by nanovllm/wiring/): the errors that refuse a request, the checks of the feature fields
a request sets, aborts and abandoned steps, and the refusals of a shut or broken engine. `engine`
is an LLMEngine, or serve/preparation.py's RequestPreparer for the request checks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanovllm.core.sequence import SequenceStatus
from nanovllm.limits import describe_ids

if TYPE_CHECKING:
    from nanovllm.core.engine import LLMEngine
    from nanovllm.core.lifecycle import RequestLifecycle
    from nanovllm.core.scheduler import ScheduledBatch
    from nanovllm.core.sequence import Sequence
    from nanovllm.sampling_params import SamplingParams


# ---------------------------------------------------------------- refused requests
def reject_prompt(engine: LLMEngine, prompt, ids: list[int] | None) -> None:
    """Why LLMEngine.tokenize refuses `prompt` (`ids`: its token ids, None if it has none)."""
    if isinstance(prompt, str):
        if engine.tokenizer is None:
            raise ValueError("prompts must be token ids when skip_tokenizer_init=True")
    elif ids is None:
        raise TypeError(f"a prompt must be a str or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("empty prompt")
    bad = [t for t in ids if not 0 <= t < engine.vocab_size]
    what = f"token id {bad[0]} is" if len(bad) == 1 else f"token ids {describe_ids(bad)} are"
    raise ValueError(f"{what} outside the vocabulary [0, {engine.vocab_size})")


def check_params(engine: LLMEngine, p: SamplingParams) -> None:
    """LLMEngine.prepare_params' checks of the fields that need the model: token ids inside the
    vocabulary, logprobs within max_logprobs, a tokenizer for stop strings, n within max_num_seqs."""
    vocab = engine.vocab_size
    for name, ids in (("stop_token_ids", p.stop_ids), ("logit_bias", p.bias or ()),
                      ("allowed_token_ids", p.allowed_ids or ())):
        if bad := sorted(t for t in ids if t >= vocab):
            raise ValueError(f"{name}: token ids {describe_ids(bad)} are outside the vocabulary [0, {vocab})")
    cap = engine.config.max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(p, name)
        if k is not None and cap != -1 and (k == -1 or k > cap):
            raise ValueError(f"SamplingParams.{name}={k}: more than max_logprobs={cap} "
                             f"(an LLM option; -1 allows the whole vocabulary)")
    if p.stop_strings and engine.tokenizer is None:
        raise ValueError("stop strings need a tokenizer (skip_tokenizer_init=True was given)")
    if p.n > engine.config.max_num_seqs:
        raise ValueError(f"SamplingParams.n={p.n}: more than max_num_seqs={engine.config.max_num_seqs} "
                         "samples can never run together")


def check_fits(engine: LLMEngine, num_prompt_tokens: int, params: SamplingParams) -> None:
    """LLMEngine.check_fits for a request that may not fit (or has n > 1 samples): a ValueError
    saying why it could never be served."""
    cfg = engine.config
    if num_prompt_tokens > cfg.max_model_len:
        raise ValueError(f"prompt of {num_prompt_tokens} tokens is longer than max_model_len={cfg.max_model_len}")
    total = num_prompt_tokens + params.max_tokens
    if total > cfg.max_model_len:
        raise ValueError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) = {total} "
                         f"exceeds max_model_len={cfg.max_model_len}")
    # The last generated token's K/V is never written, hence total - 1.
    bm = engine.block_manager
    blocks = bm.blocks_for(total - 1)
    if blocks > bm.num_blocks:
        raise ValueError(f"prompt + max_tokens = {total} tokens need {blocks} KV blocks, but the whole cache "
                         f"has {bm.num_blocks}")
    # n > 1: the prompt's blocks plus a copy of its partly filled last block per extra sample.
    first = bm.blocks_for(num_prompt_tokens) + (params.n - 1) * (num_prompt_tokens % bm.block_size != 0)
    if first > bm.num_blocks:
        raise ValueError(f"n={params.n} samples of a {num_prompt_tokens}-token prompt need {first} KV blocks "
                         f"to start, but the whole cache has {bm.num_blocks}")


def no_tokenizer(path: str, files: tuple[str, ...], error: Exception | None) -> None:
    """load_tokenizer's ValueError: no tokenizer `files` in `path`, or `error` loading one."""
    why = f"could not load a tokenizer from {path!r} ({type(error).__name__}: {error})" if error is not None \
        else f"no tokenizer files in {path!r} (expected one of {', '.join(files)})"
    raise ValueError(f"{why}; pass skip_tokenizer_init=True to run on token ids only") from None


def track_text(requests: RequestLifecycle, seq: Sequence, streamed: bool) -> None:
    """The text state of a request just added that streams its text (`streamed`) or has stop strings."""
    p = seq.params
    if requests.tokenizer is None or not p.detokenize:
        return
    if requests.track_text is None:
        raise ValueError("streamed text and stop strings need the text tracking that LLM wires in")
    for sample in seq.samples:
        requests._detok[sample.seq_id] = requests.track_text(requests.tokenizer, sample.prompt_token_ids, p)
        if streamed:
            requests._streamed.add(sample.seq_id)


# ---------------------------------------------------------------- aborts, failed steps, a shut or broken engine
def abort(requests: RequestLifecycle, seq: Sequence) -> None:
    """LLMEngine.abort: an unfinished request ends, freeing its blocks (one that ended, also at
    launch with its last token on its way, is left alone)."""
    if not seq.is_finished:
        abandon(requests, [seq])


def abandon(requests: RequestLifecycle, seqs: list[Sequence]) -> None:
    """End `seqs` now ("abort"), with the samples never forked off them: the rows of a launched step
    whose tokens will never be read (also those ended at launch: their last token never comes)."""
    for seq in seqs:
        if seq.status != SequenceStatus.FINISHED:
            if seq.has_pending_token:  # nobody will read it
                seq.token_ids.pop()
                seq.pending_row = -1
            seq.drafts = []
            requests.end(seq, "abort")
            requests.forget_text(seq)
            abandon(requests, seq.pending_forks)


def cancel_in_flight(engine: LLMEngine) -> None:
    """LLMEngine.cancel_in_flight: forget the launched step without waiting for it, ending its
    unfinished requests. The device may still be running it; later steps queue behind it, so the
    KV blocks it writes are never read before it is done."""
    step, engine._in_flight = engine._in_flight, None
    if step is not None:
        abandon(engine.requests, step.batch.rows)


def failed(engine: LLMEngine, e: BaseException, batches: tuple[ScheduledBatch | None, ...], breaks: bool) -> None:
    """LLMEngine._guarded's work raised `e`: the requests of `batches` end (their tokens will never
    be read) or, with `breaks` (a change of the scheduler's state, so half done), every later step
    refuses to run."""
    if breaks:
        engine._broken = f"{type(e).__name__}: {str(e)[:200]}"
    for batch in batches:
        if batch is not None:
            abandon(engine.requests, batch.rows)


def refuse(engine: LLMEngine) -> None:
    """Why a shut or broken engine refuses to step."""
    if engine._closed:
        raise RuntimeError("this LLM has been shut down")
    raise RuntimeError(f"this LLM's requests are in an unknown state after an error inside a step "
                       f"({engine._broken}); create a new LLM")
