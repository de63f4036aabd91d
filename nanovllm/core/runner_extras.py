"""What a ModelRunner runs only when asked: score() (tests check the model against a reference
with it), random weights (load_format="dummy": model/dummy_weights.py), the set-up of speculation,
adapters and KV-scale calibration, and the extra rows and KV block copies of forked samples and
prompt logprobs. nanovllm/wiring/ registers this module's loader in core/model_runner.py
(RUNNER_EXTRAS): a plain generate never loads it."""

from __future__ import annotations

import torch

from nanovllm.model.attention import host_to_device, prefill_metadata
from nanovllm.model.dummy_weights import init_dummy  # noqa: F401  (ModelRunner._build_model's)
from nanovllm.sampling_params import is_integer


def check_score_input(config, token_ids: list[int]) -> None:
    """score()'s input checks, on the caller's rank before any rank starts (a worker that
    raised would take the whole tensor-parallel group down)."""
    n = len(token_ids)
    if not 0 < n <= config.max_model_len:
        raise ValueError(f"score() needs 1 to max_model_len={config.max_model_len} tokens, got {n}")
    vocab = config.hf_config.vocab_size
    if not all(is_integer(t) and 0 <= t < vocab for t in token_ids):
        raise ValueError(f"score() needs token ids in [0, {vocab})")


@torch.inference_mode()
def score(runner, token_ids: list[int]) -> torch.Tensor:
    """ModelRunner.score: `runner`'s teacher-forced logits of one sequence."""
    check_score_input(runner.config, token_ids)
    n = len(token_ids)
    meta = prefill_metadata([n], [n], torch.full((n,), -1, dtype=torch.int32), None, runner.device)
    ids = torch.tensor(token_ids, dtype=torch.long, device=runner.device)
    hidden = runner.model(ids, torch.arange(n, device=runner.device), meta)
    logits = runner.model.compute_logits(hidden)
    return None if logits is None else logits.float()


def prepare_features(runner) -> None:
    """Fit the model for speculative decoding's draft and attach per-request adapters (LoRA),
    before the KV cache takes the memory left."""
    config = runner.config
    max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
    if config.speculation is not None:
        config.speculation.prepare_model(runner.model, max_tokens)
    if config.adapters is not None:
        runner.adapters = config.adapters(runner, max_tokens)
        runner.adapters.attach(runner.model)


def arm_kv_calibration(runner) -> None:
    """Have the next prefill calibrate the KV scales of the layers whose checkpoint gave none."""
    for layer in runner.attn_layers:
        if not getattr(layer, "kv_scales_from_checkpoint", False):
            layer.calibrate_next_prefill = runner.config.kv_calibrator


def extra_rows(runner, hidden: torch.Tensor, step, every: torch.Tensor | None) -> torch.Tensor:
    """hidden + the rows forked samples sample from + the prompt-logprob positions (of all
    the step's tokens, `every`), in that order: one LM-head call (one gather) for all."""
    parts = [hidden]
    for rows, source in ((step.fork_rows, hidden), (step.prompt_rows, every)):
        if rows:
            parts.append(source.index_select(0, host_to_device(rows, torch.long, runner.device, runner.sampler.pin)))
    return torch.cat(parts)


def copy_blocks(cache: torch.Tensor, copies: list[tuple[int, int]], device: torch.device) -> None:
    """KV blocks src -> dst in every layer of `cache` (copy on write of a prompt's last block for
    the samples forked from it)."""
    pin = device.type == "cuda"
    src = host_to_device([a for a, _ in copies], torch.long, device, pin)
    dst = host_to_device([b for _, b in copies], torch.long, device, pin)
    cache[:, :, dst] = cache.index_select(2, src)
