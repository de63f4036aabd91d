"""The engine loop: validate requests, then schedule -> launch the model -> account, step by step,
with the accounting of step n done while the device runs step n+1 (see LLMEngine.step)."""

from __future__ import annotations

import itertools
import logging
import os
import random
from typing import TYPE_CHECKING, Callable

from nanovllm.config import Config
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.interrupts import deferred_interrupts
from nanovllm.core.lifecycle import InFlightStep, RequestLifecycle, StepOutput, StepResult
from nanovllm.core.model_runner import ModelRunner
from nanovllm.core.scheduler import ScheduledBatch, Scheduler
from nanovllm.core.sequence import Sequence
from nanovllm.limits import check_unicode
from nanovllm.model.checkpoint import read_json
from nanovllm.sampling_params import SamplingParams, as_token_ids, derive_sample_seed

if TYPE_CHECKING:
    from types import ModuleType

    from nanovllm.core.executor import Executor, ExecutorFactory
    from nanovllm.core.hooks import ForwardStrategy, ModelFeatures
    from nanovllm.core.kv_usage import KVUsage
    from nanovllm.core.step_timing import StepTiming

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "StepOutput", "StepResult"]

# Slots nanovllm/wiring/ fills at import, each loading its module at first use: step_timing.py (what
# `step_observers` get) and engine_extras.py (refusals, aborts, a failed step).
load_step_timing: Callable[[], ModuleType]
EXTRAS: Callable[[], ModuleType] | None = None


class LLMEngine:
    """Validates requests and drives the loop: schedule -> run the model -> account for the step.
    `LLM` (nanovllm/llm.py) is the user-facing subclass. One thread drives an engine.
    `step_observers`: callables that get a StepTiming (core/step_timing.py) at the end of every step."""

    def __init__(self, model: str, *, start_executor: ExecutorFactory | None = None,
                 model_features: ModelFeatures | None = None, **kwargs):
        """`start_executor(config)` makes the executor (default: in this process); `model_features`
        (core/hooks.py): what the front wires in (a model or option needing one is a ValueError)."""
        self.config = config = Config.from_kwargs(model, **kwargs).resolve(model_features)
        self.tokenizer = None
        if not config.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(config.tokenizer or config.model, config.tokenizer_mode,
                                            config.trust_remote_code, config.revision)
        self.eos_token_ids = find_eos_token_ids(config.model, config.hf_config, self.tokenizer)
        gc = config.generation_config  # "auto": the model's, "vllm": none, or a folder holding one
        self.generation_defaults = {} if gc == "vllm" else read_generation_defaults(config.model if gc == "auto" else gc)
        self.vocab_size = config.hf_config.vocab_size
        self.model_runner: Executor = (start_executor or start_in_process)(config)
        self.block_manager = BlockManager(self.model_runner.num_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.requests = RequestLifecycle(self.scheduler, self.tokenizer, self.eos_token_ids, config.max_model_len,
                                         release=self.model_runner.release)
        self.step_observers: list[Callable[[StepTiming], None]] = []
        self._rng = random.Random(config.seed)
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self._in_flight: InFlightStep | None = None  # the launched step not yet accounted for
        self._closed = False
        self._broken: str | None = None  # why the requests' state is unknown (see _guarded)

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt) -> list[int]:
        """A prompt (text or token ids) as a validated list of token ids."""
        if isinstance(prompt, str):
            ids = encode_text(self.tokenizer, prompt, "the prompt") if prompt and self.tokenizer is not None else None
        else:
            ids = as_token_ids(prompt) if isinstance(prompt, (list, tuple)) else None
        if not ids or min(ids) < 0 or max(ids) >= self.vocab_size:  # (C loops)
            EXTRAS().reject_prompt(self, prompt, ids)
        return ids

    def get_default_sampling_params(self) -> SamplingParams:
        """A new SamplingParams with the model's generation_config.json defaults (vLLM's)."""
        return SamplingParams(**self.generation_defaults)

    def get_tokenizer(self):
        return self.tokenizer

    def kv_usage(self) -> KVUsage:
        """The KV cache's use now (BlockManager.usage), cheap enough to sample after every step."""
        return self.block_manager.usage(self.scheduler.running)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix; False (and nothing forgotten) while requests run."""
        return self.block_manager.reset_prefix_cache()

    def prepare_params(self, params: SamplingParams) -> SamplingParams:
        """The engine's validated, immutable copy of `params` (SamplingParams.snapshot), after the
        checks that need the model of the fields that are set (engine_extras.check_params)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        p = params.snapshot()
        if p.stop_ids or p.bias or p.allowed_ids or p.stop_strings or p.n > 1 or p.logprobs is not None \
                or p.prompt_logprobs is not None:
            EXTRAS().check_params(self, p)
        return p

    def room_after(self, num_prompt_tokens: int) -> int:
        """The most tokens a request may generate after its prompt, within max_model_len and the
        whole KV cache (the last token's K/V is never written)."""
        bm = self.block_manager
        return min(self.config.max_model_len, bm.num_blocks * bm.block_size + 1) - num_prompt_tokens

    def prepare_for_prompt(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """prepare_params, with max_tokens=None made what a prompt of this length leaves
        (room_after, at least 1: a prompt that leaves none fails check_fits)."""
        if params.max_tokens is None:
            params = params.clone()
            params.max_tokens = max(1, self.room_after(num_prompt_tokens))
        return self.prepare_params(params)

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Reject a request that could never be served, before any work starts (`params` as
        prepare_params returns them); engine_extras.check_fits says why (and checks n > 1)."""
        total, bm = num_prompt_tokens + params.max_tokens, self.block_manager
        # (The last generated token's K/V is never written, hence total - 1.)
        if total > self.config.max_model_len or bm.blocks_for(total - 1) > bm.num_blocks or params.n > 1:
            EXTRAS().check_fits(self, num_prompt_tokens, params)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, track_text: bool = False,
                    prompt: str | None = None, adapter: int = 0) -> Sequence:
        """Queue a validated request (see `tokenize` / `check_fits`); its Sequence (n > 1: sample 0,
        holding all n in `samples`). `track_text`: its text increments will be read (stream)."""
        params = params if getattr(params, "_frozen", False) else \
            self.prepare_for_prompt(params, len(prompt_ids))
        seq = self._new_sample(prompt_ids, params, 0, adapter)
        seq.request_id, seq.prompt_text = str(next(self._request_ids)), prompt
        for hook in self.scheduler.hooks:  # (n > 1: the request's other samples)
            hook.added(seq, lambda i: self._new_sample(prompt_ids, params, i, adapter))
        if len(seq.samples) != params.n:
            raise ValueError(f"SamplingParams.n={params.n} needs the parallel-sampling hook (LLM wires it in)")
        self.requests.add(seq)
        if track_text or params.stop_strings:
            EXTRAS().track_text(self.requests, seq, track_text)
        return seq

    def _new_sample(self, prompt_ids: list[int], params: SamplingParams, i: int, adapter: int = 0) -> Sequence:
        seed = derive_sample_seed(params.seed, i) if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(next(self._seq_ids), prompt_ids, params, seed, sample_index=i)
        seq.adapter = adapter
        return seq

    def abort(self, seq: Sequence) -> None:
        """Drop an unfinished request wherever it is, freeing its blocks."""
        EXTRAS().abort(self.requests, seq)

    def forget_text(self, seq: Sequence) -> None:
        self.requests.forget_text(seq)

    def final_text(self, seq: Sequence) -> str:
        return self.requests.final_text(seq)

    def cancel_in_flight(self) -> None:
        """Forget the launched step without waiting for it, ending its unfinished requests."""
        EXTRAS().cancel_in_flight(self)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ------------------------------------------------------------------ the loop
    def step(self) -> StepResult:
        """One engine step, overlapped with the device: schedule and launch step n+1, then wait for
        step n's tokens and account for them while the device runs n+1; returns step n's outputs. If
        launching n+1 or waiting for n raises, the requests of both steps end ("abort") and the
        exception propagates. A Ctrl-C is raised once the step is complete."""
        self._check_usable()
        with deferred_interrupts():
            batch = self._guarded(self.scheduler.schedule, breaks=True)
            done, self._in_flight = self._in_flight, None
            if batch is None and done is None:
                raise RuntimeError("scheduler produced no work although requests are pending")
            launched = self._launch(batch, done) if batch is not None else None
            outputs, waited = self._resolve(done, launched) if done is not None else ([], 0.0)
            if launched is not None:
                # After resolving step n: a request that step n stopped is skipped in n+1 (its
                # row was computed for nothing, one row once per request).
                self._guarded(lambda: self.requests.launched(batch), breaks=True)
                self._in_flight = launched
            return self._step_result(done if done is not None else launched, done is not None, outputs, waited)

    def _check_usable(self) -> None:
        if self._closed or self._broken is not None:
            EXTRAS().refuse(self)

    def _guarded(self, work, *batches: ScheduledBatch | None, breaks: bool = False):
        """work(); if it raises, the requests of `batches` end or, with `breaks`, every later step
        refuses to run (engine_extras.failed); the exception propagates."""
        try:
            return work()
        except BaseException as e:
            EXTRAS().failed(self, e, batches, breaks)
            raise

    def _launch(self, batch: ScheduledBatch, done: InFlightStep | None) -> InFlightStep:
        shape = load_step_timing().StepShape.of(batch) if self.step_observers else None  # before it advances
        # A failed launch may have queued part of step n+1, overwriting step n's tokens on the
        # device that a later step would read: neither can be trusted.
        return self._guarded(lambda: InFlightStep(batch, self.model_runner.launch(batch, self.eos_token_ids), shape),
                             done and done.batch, batch)

    def _resolve(self, done: InFlightStep, launched: InFlightStep | None) -> tuple[list[StepOutput], float]:
        # Waiting for step n failed with n+1 already launched on n's tokens: neither step can be
        # accounted for any more, so their requests end.
        return self._guarded(lambda: done.resolve(self.requests), done.batch, launched and launched.batch)

    def _step_result(self, step: InFlightStep, resolved: bool, outputs: list[StepOutput],
                     waited: float) -> StepResult:
        """`step`: the step resolved, or (resolved False) the first one, which only launched."""
        if self.step_observers:
            load_step_timing().observe(self.step_observers, step, resolved, waited)
        return StepResult(outputs, step.batch.num_tokens if resolved else 0, step.batch.is_prefill)

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """Free the GPU memory and stop tensor-parallel workers; the engine refuses work afterwards."""
        self._closed = True
        runner = getattr(self, "model_runner", None)
        if runner is not None:
            runner.shutdown()


def start_in_process(config: Config, forward_strategy: ForwardStrategy | None = None) -> Executor:
    """The executor of a model in this process: a ModelRunner (LLMEngine's default; several
    processes are the front's to start)."""
    return ModelRunner(config, forward_strategy)


def encode_text(tokenizer, text: str, what: str, **kwargs) -> list[int]:
    """tokenizer.encode(text, **kwargs), with a ValueError naming `what` for text that is not
    valid Unicode (the tokenizers library reports a lone surrogate as a TypeError)."""
    try:
        return tokenizer.encode(text, **kwargs)
    except (TypeError, UnicodeError):
        check_unicode(text, what)
        raise


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str, mode: str = "auto", trust_remote_code: bool = False, revision: str | None = None):
    """The tokenizer in `path` (LLM's `tokenizer` option, else the checkpoint folder), or a
    ValueError that says how to run without one. mode "slow": the Python tokenizer (vLLM's)."""
    from transformers import AutoTokenizer

    # transformers 5 returns an empty tokenizer for a folder without tokenizer files instead of failing.
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        EXTRAS().no_tokenizer(path, TOKENIZER_FILES, None)
    try:
        return AutoTokenizer.from_pretrained(path, use_fast=mode != "slow", trust_remote_code=trust_remote_code,
                                             revision=revision)
    except Exception as e:
        EXTRAS().no_tokenizer(path, TOKENIZER_FILES, e)


# generation_config.json keys that become the default SamplingParams, as vLLM reads them.
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_generation_config(path: str) -> tuple[str, dict]:
    """The path of a checkpoint folder's generation_config.json and what it holds ({} if none)."""
    gen_file = os.path.join(path, "generation_config.json")
    return gen_file, read_json(gen_file) if os.path.isfile(gen_file) else {}


def read_generation_defaults(path: str) -> dict:
    """The sampling defaults that the checkpoint's generation_config.json sets (vLLM's
    generation_config="auto"), checked: a bad value is a ValueError naming the file."""
    gen_file, data = read_generation_config(path)
    defaults = {k: data[k] for k in GENERATION_DEFAULT_FIELDS if data.get(k) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{gen_file}: {e}") from None
    return defaults


def find_eos_token_ids(path: str, hf_config, tokenizer) -> frozenset[int]:
    """EOS ids from the tokenizer, config.json and generation_config.json (Qwen3 lists several)."""
    found = [getattr(hf_config, "eos_token_id", None), read_generation_config(path)[1].get("eos_token_id"),
             tokenizer.eos_token_id if tokenizer is not None else None]
    ids = [i for v in found if v is not None for i in ([v] if isinstance(v, int) else v)]
    # An id the model can never produce cannot end a request, and must not reach the sampler's
    # min_tokens mask (an out-of-range index is a device-side assert on CUDA).
    return frozenset(i for i in ids if isinstance(i, int) and 0 <= i < hf_config.vocab_size)
