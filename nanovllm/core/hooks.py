"""The hooks the core declares: small typed protocols that features implement and the fronts
(`llm.py`, `serve/`) plug in when an option or a request asks for them. The core never names a
feature: a plain generate with no options runs the core alone. The core names these protocols in
annotations only (imported under TYPE_CHECKING), so a plain generate does not load this module."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable  # noqa: F401

if TYPE_CHECKING:
    import torch

    from nanovllm.core.scheduler import ScheduledBatch, Scheduler
    from nanovllm.core.sequence import Sequence
    from nanovllm.sampling_params import SamplingParams

# ---------------------------------------------------------------- logits (sampling extensions)
# TokenSampler (core/sampling.py) calls these on rank 0 for the rows whose SamplingParams they
# apply to; a batch in which no row asks for any runs the basic sampler alone.


class LogitsExtension(Protocol):
    """A per-request change of the logits before the draw (penalties, logit_bias, banned or
    allowed tokens). Extensions transform in increasing `order` (vLLM's: allowed ids, bad words,
    bias, then penalties), on an fp32 copy of the logits [rows, V]."""

    order: int

    def applies(self, params: SamplingParams) -> bool:
        """Whether a row with these parameters needs this extension."""

    def build(self, rows: list[Sequence], where: list[int], vocab_size: int) -> object:
        """The batch's device state for rows[i], i in `where` (the rows it applies to); called
        when the batch's rows change, and kept while they do not."""

    def prepare(self, state: object, step=None) -> bool:
        """Start the step's host work for `transform`; True if it runs in the background (the
        draw then waits for the next launch: the work overlaps the engine's bookkeeping)."""

    def transform(self, logits: torch.Tensor, state: object, step=None) -> None:
        """Change `logits` (fp32 [rows, V]) in place, every step. `step`: the StepInput (a row
        that verifies a draft has that draft as its input token, step.token_ids[row])."""

    def observe(self, state: object, tokens: torch.Tensor) -> None:
        """The step's sampled tokens int64 [rows], on the device."""

    def release(self, seq: Sequence) -> None:
        """`seq` ended: drop what the extension keeps for it."""


class StepLogprobs(Protocol):
    """A step's logprob entries on the host, which the lifecycle (RequestLifecycle.accept) hands
    to their requests: `sample[row]` for the sampling rows that asked. An entry is (logprob,
    rank, top ids, top logprobs) of one token (Sequence.logprobs)."""

    sample: dict[int, tuple]

    def add_prompt_entries(self, batch: ScheduledBatch) -> None:
        """Extend the prompt_logprobs of the batch's requests that ask by their entries."""

    def take(self, seq: Sequence, row: int) -> tuple:
        """The entry of `seq`'s token sampled in `row`, added to its logprobs and cumulative_logprob."""


class PendingLogprobs(Protocol):
    def result(self) -> StepLogprobs:
        """The entries, once the step's tokens have reached the host."""


class LogprobsExtension(Protocol):
    """The output side: logprobs of the sampled tokens (rows that ask) and of the step's prompt
    positions (StepInput.prompt_rows, whose logits rows follow the sampling rows), read from
    the raw logits and copied to the host with the tokens."""

    def applies(self, params: SamplingParams) -> bool:
        """Whether a row with these parameters wants its sampled tokens' logprobs."""

    def build(self, rows: list[Sequence], where: list[int], vocab_size: int) -> object:
        """As LogitsExtension.build."""

    def gather(self, state: object | None, logits: torch.Tensor, tokens: torch.Tensor,
               prompt_logits: torch.Tensor | None, step) -> PendingLogprobs:
        """Queue the step's logprobs (state None: no sampling row asks; prompt_logits None: no
        prompt positions) for the host, without waiting."""


class ShardSampling(Protocol):
    """Sampling on every tensor-parallel rank from its vocabulary shard (StepInput.sampling, set
    by the launchers for steps that need no gathered logits)."""

    def sample(self, sampler, model, hidden: torch.Tensor) -> torch.Tensor:
        """The rows' tokens from `hidden` through the model's LM-head shard, the same on every
        rank, also left in `sampler`'s (TokenSampler's) device buffer."""


class LogitsProcessing(Protocol):
    """What TokenSampler's draw becomes once a request asks for a LogitsExtension or the
    LogprobsExtension (features/logits/processing.py, installed by the fronts): it holds them and
    draws the step's tokens through them."""

    logprobs: LogprobsExtension | None

    def sample(self, logits: torch.Tensor, rows: list[Sequence], offsets: list[int], suppress, check, step,
               defer: bool):
        """As TokenSampler.sample, whose min_tokens suppression (`suppress`) and noise offsets it
        takes; with `defer`, a draw waiting for background work returns a PendingTokens look-alike."""

    def flush(self) -> None:
        """Queue the deferred draw, if any (TokenSampler.flush)."""

    def release(self, seq: Sequence) -> None:
        """`seq` ended: every extension drops its state."""


# ---------------------------------------------------------------- scheduling
# The scheduler (core/scheduler.py) runs pending prompt work alone, else one decode token for
# every running sequence. A StepPolicy (Scheduler.policy) composes steps otherwise; features
# that follow requests through scheduling are SchedulingHooks (Scheduler.hooks).


class StepPolicy(Protocol):
    """How a step is composed from the scheduler's parts (Scheduler.prompt_work, decode_rows,
    decode_batch) instead of prompt work first (for example decode rows beside prompt chunks)."""

    def compose(self, scheduler: Scheduler) -> ScheduledBatch | None: ...


class SchedulingHook(Protocol):
    """A feature that follows requests from their arrival through scheduling (n > 1 forks,
    prompt logprobs). Every method does nothing here: a feature subclasses this and overrides
    what it needs."""

    def added(self, seq: Sequence, new_sample: Callable[[int], Sequence]) -> None:
        """A request arrived as `seq` (its sample 0); `new_sample(i)` makes its sample i."""

    def admit(self, scheduler: Scheduler, seq: Sequence) -> bool:
        """Whether `seq` may start running now (a LoRA adapter needs a free slot); False keeps
        it waiting, at the head of the queue."""
        return True

    def reserve(self, seq: Sequence, block_size: int) -> tuple[int, int]:
        """(sampling rows, free KV blocks) to hold for `seq` from its admission on, beyond its
        own: the rows count against max_num_seqs until the hook pops Scheduler.held_rows[seq];
        the blocks are seq.reserved_blocks (BlockManager.allocate)."""
        return 0, 0

    def scheduled(self, scheduler: Scheduler, batch: ScheduledBatch) -> None:
        """A step was composed: add to it (ScheduledBatch.forks, prompt_rows)."""

    def launched(self, scheduler: Scheduler, batch: ScheduledBatch, max_model_len: int) -> None:
        """The step was launched and its sequences advanced (Scheduler.advance)."""


class DraftVerifier(Protocol):
    """Keeps the tokens of a row that verified its drafts (Sequence.drafts), for the speculative
    decoding that drafted them (RequestLifecycle.verifier: features/speculative/drafting.py)."""

    def verify(self, seq: Sequence, sampled: list[int], take: Callable[[int, int], bool]) -> list[int]:
        """`seq`'s new tokens, `sampled[j]` being the token sampled after its draft j: each is
        filled in, then take(j, token) accounts for it, True when it ended the request."""


# ---------------------------------------------------------------- text tracking
# RequestLifecycle (core/lifecycle.py) makes a TextTracker per sample of a request that streams
# its text or has stop strings, through the factory the front wires in (features/text_tracking.py).


class TextTracker(Protocol):
    """A request's output text as its tokens arrive: increments to stream, stop strings found."""

    text: str  # everything so far (the final text once finished)
    stop_string: str | None  # the stop string that ended the request, if one did

    def add(self, token_ids: list[int]) -> bool:
        """Decode newly arrived tokens; True when a stop string appeared."""

    def finish(self) -> bool:
        """The request ends: flush the text held back; True when that completes a stop string."""

    def pop_delta(self, finished: bool) -> str:
        """The text that became stable since the last call (all of it once `finished`)."""


# TextTracker factory: (tokenizer, prompt token ids, SamplingParams) -> TextTracker.
TextTrackerFactory = Callable[..., TextTracker]


# ---------------------------------------------------------------- forward strategy (graphs)


class ForwardStrategy(Protocol):
    """Another way than the eager forward to run a prefill-shaped step (piecewise CUDA graphs:
    features/prefill_graphs.py). The model runner asks it about every prefill step, and runs the
    step eagerly when it declines."""

    max_prefill_tokens: int  # the largest step it may run (the KV budget charges its memory first)

    def prepare(self, runner) -> bool:
        """Get ready (capture) on `runner` (a ModelRunner with its model, KV cache and decode
        graphs); False when it cannot serve this model (the runner then runs eagerly)."""

    def runs_prefill(self, num_tokens: int) -> bool:
        """Whether it runs a prefill step of `num_tokens` tokens."""

    def run_prefill(self, ids, positions, meta):
        """The final hidden states [num_tokens, hidden] of the step, as model(ids, positions, meta)."""


# ---------------------------------------------------------------- the model's features (Config.resolve)


class Speculation(Protocol):
    """What the core asks of speculative decoding's options (Config.speculation): the share of
    the KV budget a draft model takes, whose K/V live in the engine's blocks beside the model's."""

    def kv_bytes_per_block(self, block_size: int, dtype) -> int:
        """The draft model's K/V bytes per block (0 without one)."""

    def weight_bytes(self, dtype) -> int:
        """About what the draft model's weights take (0 without one)."""

    def prepare_model(self, model, max_tokens: int) -> None:
        """Called on the built model before the KV budget is measured and the graphs captured
        (both then count what it adds), for steps of up to `max_tokens` tokens: EAGLE-3 has the
        decoder keep three layers' inputs for its head (features/speculative/layer_inputs.py)."""


class Adapters(Protocol):
    """Per-request weight adapters (LoRA: features/lora/), one per rank: `attach` changes the
    built model before its memory is measured and its graphs captured; `prepare` runs before
    each step's forward pass (eager or a graph replay), with the step's StepInput (`adapters`:
    each entry's slot; `adapter_loads`: adapters to place in slots first)."""

    def attach(self, model) -> None: ...

    def prepare(self, step) -> None: ...


class AfterSampling(Protocol):
    """Runs after each step's sampling is queued (ModelRunner.after_sampling, one process),
    before the host has the tokens: the step's inputs (ModelRunner.forward_inputs), the hidden
    states the model kept and the sampled tokens (TokenSampler.prev_tokens) are still on the
    device. EAGLE-3's head (features/speculative/eagle3.py) reads them there."""

    def after_sampling(self, runner, batch: ScheduledBatch, step) -> None: ...


class ModelFeatures(Protocol):
    """What Config.resolve asks of the features the front wires in (nanovllm/wiring/): each
    answer is an object the model runner plugs into a hook of model/, or None when the model and
    options need none."""

    def quantization_scheme(self, checkpoint_config: dict | None, requested: str | None):
        """The linear layers' weight scheme (model/quant.py's QuantScheme) for the checkpoint's
        quantization_config and LLM(quantization=...), or None."""

    def kv_scale_calibrator(self, calculate_kv_scales: bool):
        """The attention layers' KVScaleCalibrator (model/attention/layer.py), or None."""

    def sparse_mlp(self, decoder_options):
        """The MoE block factory (model/decoder.py's SparseMlpFactory) of a model whose
        DecoderOptions have MoE layers, or None."""

    def speculation(self, speculative_config: dict | None, hf_config, tensor_parallel_size: int) -> Speculation | None:
        """The checked options of LLM(speculative_config=...) for this (target) model and
        parallelism, or None; a SchedulingHook then drafts."""

    def adapters(self, lora_config, hf_config):
        """A factory (picklable: each rank calls it with its model runner and the most tokens a
        step holds) of the rank's Adapters for LLM(enable_lora=True, ...), or None."""

    def check_processes(self, config, hf_config) -> None:
        """A ValueError unless the engine's processes (tensor_parallel_size x data_parallel_size)
        fit the model's heads and this node's GPUs."""
