"""What a ModelRunner runs only when asked: score() (tests check the model against a reference
with it) and random weights (load_format="dummy": model/dummy_weights.py). nanovllm/wiring/
registers this module's loader in core/model_runner.py (RUNNER_EXTRAS): a plain generate never
loads it."""

from __future__ import annotations

import torch

from nanovllm.model.attention import prefill_metadata
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
