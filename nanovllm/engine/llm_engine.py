"""The engine loop: validate requests, then schedule -> launch the model -> account, step by step,
with the accounting of step n done while the device runs step n+1 (see LLMEngine.step)."""

from __future__ import annotations

import itertools
import logging
import os
import random
from dataclasses import dataclass

from nanovllm.config import Config, read_json
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.detokenizer import IncrementalDetokenizer, detokenize
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.sampling_params import SamplingParams, is_integer

logger = logging.getLogger("nanovllm")


@dataclass
class StepOutput:
    """What one step did for one request: the tokens and text it added, and whether it ended.

    `text` is the newly stable text (only for requests that track text: streaming or stop
    strings); `finish_reason` is "stop" or "length" once `finished`.
    """

    seq: Sequence
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


class LLMEngine:
    """Validates requests and drives the loop: schedule -> run the model -> account for the step.

    `LLM` (nanovllm/llm.py) is the user-facing subclass; this class holds the engine state: the
    scheduler and block manager, the model runner (one per tensor-parallel rank), the tokenizer
    and the per-request detokenizers.
    """

    def __init__(self, model: str, **kwargs):
        self.config = config = Config.from_kwargs(model, **kwargs)
        hf = config.hf_config
        self.tokenizer = None
        if not config.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = frozenset(find_eos_token_ids(config.model, hf, self.tokenizer))
        self.vocab_size = hf.vocab_size
        self.model_runner = self._start_model_runner(config)
        self.block_manager = BlockManager(self.model_runner.num_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self._rng = random.Random(config.seed)
        self._seq_ids = itertools.count()
        self._detok: dict[int, IncrementalDetokenizer] = {}
        self._streamed: set[int] = set()  # requests whose text increments someone reads
        self._in_flight = None  # (batch, PendingTokens) of the launched step not yet accounted for
        self._closed = False

    def _start_model_runner(self, config: Config):
        if config.tensor_parallel_size > 1:
            from nanovllm.engine.parallel import TensorParallelRunner

            return TensorParallelRunner(config)
        from nanovllm.engine.model_runner import ModelRunner

        return ModelRunner(config)

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt) -> list[int]:
        """A prompt (text or token ids) as a validated list of token ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompts must be token ids when skip_tokenizer_init=True")
            if not prompt:
                raise ValueError("empty prompt")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(is_integer(t) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            raise TypeError(f"a prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("empty prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Reject a request that could never be served, before any work starts."""
        cfg = self.config
        if num_prompt_tokens > cfg.max_model_len:
            raise ValueError(f"prompt of {num_prompt_tokens} tokens is longer than max_model_len={cfg.max_model_len}")
        total = num_prompt_tokens + params.max_tokens
        if total > cfg.max_model_len:
            raise ValueError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) = {total} "
                             f"exceeds max_model_len={cfg.max_model_len}")
        outside = [t for t in params.stop_ids if t >= self.vocab_size]
        if outside:
            raise ValueError(f"stop_token_ids {outside} are outside the vocabulary [0, {self.vocab_size})")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init=True was given)")
        # The last generated token's K/V is never written, hence total - 1.
        blocks = self.block_manager.blocks_for(total - 1)
        if blocks > self.block_manager.num_blocks:
            raise ValueError(f"prompt + max_tokens = {total} tokens need {blocks} KV blocks, but the whole cache "
                             f"has {self.block_manager.num_blocks}")

    def add_request(self, prompt_ids: list[int], params: SamplingParams, track_text: bool = False) -> Sequence:
        """Queue an already validated request (see `tokenize` / `check_fits`)."""
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(next(self._seq_ids), prompt_ids, params, seed)
        self.scheduler.add(seq)
        if (track_text or params.stop_strings) and self.tokenizer is not None:
            self._detok[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop_strings)
            if track_text:
                self._streamed.add(seq.seq_id)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Drop an unfinished request wherever it is, freeing its blocks. A finished one is left
        alone: its last token may still be on its way (finished by max_tokens at launch)."""
        if seq.is_finished:
            return
        _drop_pending_token(seq)
        self.scheduler.finish(seq, "abort")
        self.forget_text(seq)

    def forget_text(self, seq: Sequence) -> None:
        """Drop a request's detokenizer state (its text will not be read)."""
        self._detok.pop(seq.seq_id, None)
        self._streamed.discard(seq.seq_id)

    def cancel_in_flight(self) -> None:
        """Forget the launched step without waiting for it (after its requests were aborted).
        The device may still be running it; later steps queue behind it, so the KV blocks it
        writes are never read before it is done."""
        done, self._in_flight = self._in_flight, None
        if done is not None:
            for seq in done[0].seqs:
                _drop_pending_token(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ------------------------------------------------------------------ the loop
    def step(self) -> tuple[list[StepOutput], int, bool]:
        """One engine step, overlapped with the device: schedule and launch step n+1, then wait
        for step n's tokens and account for them while the device runs n+1.

        Returns step n's (outputs, tokens computed, was it a prefill step). If launching step n+1
        or waiting for step n raises (KeyboardInterrupt, a dead tensor-parallel worker), the
        requests of both steps end with finish_reason "abort" and the exception propagates; other
        requests are untouched.
        """
        if self._closed:
            raise RuntimeError("this LLM has been shut down")
        # Step n's sequences already hold a placeholder for their next token (Scheduler.advance),
        # so n+1 is scheduled with the right lengths; its inputs take those tokens on the device.
        batch = self.scheduler.schedule()
        launched = None
        if batch is not None:
            try:
                launched = (batch, self.model_runner.launch(batch, self.eos_token_ids))
            except BaseException:
                # Part of step n+1 may be queued already, overwriting step n's tokens on the device
                # that a later step would read: neither can be trusted.
                done, self._in_flight = self._in_flight, None
                self._abort_steps(done, (batch, None))
                raise
        elif self._in_flight is None:
            raise RuntimeError("scheduler produced no work although requests are pending")
        done, self._in_flight = self._in_flight, None
        try:
            outputs = self._resolve(*done) if done is not None else []
        except BaseException:
            # Waiting for step n failed (Ctrl-C, a dead TP worker, ...) with n+1 already launched
            # on n's tokens: neither step can be accounted for any more, so their requests end.
            self._abort_steps(done, launched)
            raise
        if launched is not None:
            # After resolving step n: a sequence that step n stopped is skipped in n+1 (its row
            # was computed for nothing, one row once per request).
            self.scheduler.advance(batch, self.config.max_model_len)
            self._in_flight = launched
        if done is None:
            return outputs, 0, batch.is_prefill
        return outputs, done[0].num_tokens, done[0].is_prefill

    def _abort_steps(self, *steps) -> None:
        """End the requests of launched steps whose tokens will never be read."""
        for step in steps:
            if step is None:
                continue
            for seq in step[0].seqs:
                if not seq.is_finished:
                    self.abort(seq)
                elif seq.pending_row >= 0:  # ended at launch (max_tokens); its last token never came
                    _drop_pending_token(seq)
                    seq.finish_reason = "abort"

    def _resolve(self, batch, pending) -> list[StepOutput]:
        """Step n's tokens have arrived: fill them in, apply stop rules, build the outputs."""
        advanced = self.scheduler.resolve(batch, pending.result(), self.eos_token_ids)
        outputs = []
        for seq in advanced:
            text = ""
            detok = self._detok.get(seq.seq_id)
            if detok is not None:
                if detok.add([seq.token_ids[-1]]) and not seq.is_finished:
                    self.scheduler.finish(seq, "stop")
                if seq.seq_id in self._streamed:
                    text = detok.pop_delta(finished=seq.is_finished)
                if detok.stopped:
                    seq.finish_reason = "stop"
            outputs.append(StepOutput(seq, [seq.token_ids[-1]], text, seq.is_finished, seq.finish_reason))
        return outputs

    def final_text(self, seq: Sequence) -> str:
        """The finished request's output text (and forget its detokenizer). A stop string that
        only shows up once held-back text is flushed makes the finish reason "stop", as in
        stream()."""
        detok = self._detok.get(seq.seq_id)
        self.forget_text(seq)
        if detok is not None:
            if detok.finish():  # a stop string in the text held back until now
                seq.finish_reason = "stop"
            return detok.text
        return detokenize(self.tokenizer, seq.completion_token_ids) if self.tokenizer is not None else ""

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """Free the GPU memory and stop tensor-parallel workers; the engine refuses work afterwards."""
        self._closed = True
        runner = getattr(self, "model_runner", None)
        if runner is not None:
            runner.shutdown()


def _drop_pending_token(seq: Sequence) -> None:
    if seq.pending_row >= 0:  # its last token is still on the device: nobody will read it
        seq.token_ids.pop()
        seq.pending_row = -1


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str):
    """The checkpoint's tokenizer, or a ValueError that says how to run without one."""
    from transformers import AutoTokenizer

    # transformers 5 returns an empty tokenizer for a folder without tokenizer files instead of
    # failing, which would later surface as confusing "empty prompt" errors.
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ValueError(f"no tokenizer files in {path!r} (expected one of {', '.join(TOKENIZER_FILES)}); "
                         f"pass skip_tokenizer_init=True to run on token ids only")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ValueError(f"could not load a tokenizer from {path!r} ({type(e).__name__}: {e}); "
                         f"pass skip_tokenizer_init=True to run on token ids only") from None


def find_eos_token_ids(path: str, hf_config, tokenizer) -> set[int]:
    """EOS ids from the tokenizer, config.json and generation_config.json (Qwen3 lists several)."""
    ids = set(_as_id_list(getattr(hf_config, "eos_token_id", None)))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen_file = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_file):
        ids.update(_as_id_list(read_json(gen_file).get("eos_token_id")))
    # An id the model can never produce cannot end a request, and must not reach the sampler's
    # min_tokens mask (an out-of-range index is a device-side assert on CUDA).
    return {i for i in ids if isinstance(i, int) and 0 <= i < hf_config.vocab_size}
