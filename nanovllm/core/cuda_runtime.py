"""What only a CUDA engine's model runner runs: the choice of its attention backend
(model/attention/selection.py), the KV budget of the GPU's memory (here), the decode graphs
(cuda_graphs.py) and the Triton sampler (triton_sampler.py). nanovllm/wiring/ registers this
module's loader in core/model_runner.py (CUDA_RUNTIME): a CPU engine never loads it."""

from __future__ import annotations

import logging

import torch

from nanovllm.core.cuda_graphs import DecodeGraphs
from nanovllm.core.triton_sampler import TritonSampler  # noqa: F401
from nanovllm.model.attention import prefill_metadata
from nanovllm.model.attention.selection import select_backend  # noqa: F401

logger = logging.getLogger(__name__)


def capture_graphs(runner, forward_strategy) -> None:
    """TritonSampler.warm_up's and the attention backend's compiles; then, without enforce_eager,
    the decode graphs and the forward strategy's (prefill graphs) of `runner` (a ModelRunner with
    its KV cache). The torch backend loops on the host: nothing to replay."""
    config = runner.config
    runner.sampler.sampler.warm_up(config.hf_config.vocab_size, {config.dtype, torch.float32}, runner.device)
    if hasattr(runner.backend, "warm_up"):  # kernels only some steps launch (TritonBackend.warm_up)
        runner.backend.warm_up(runner.model, config.dtype)
    if config.enforce_eager or runner.backend.name == "torch":
        return
    reserved = torch.cuda.memory_reserved(runner.device)
    runner.graphs = DecodeGraphs(runner.model, runner.inputs, runner.sampler.input_tokens,
                                 min(config.max_num_seqs, 512), config.hf_config.hidden_size, config.dtype)
    if forward_strategy is not None and forward_strategy.prepare(runner):
        runner.forward_strategy = forward_strategy
    runner.graph_pool_bytes = torch.cuda.memory_reserved(runner.device) - reserved


def blocks_from_gpu_budget(runner, forward_strategy, per_block: int) -> int:
    """KV blocks of `per_block` bytes that fit in gpu_memory_utilization of `runner`'s GPU (a
    ModelRunner with its model built), counting only our own use.

    Our use = weights + the activation peak of a warm-up prefill at max_num_batched_tokens
    + what the CUDA-graph pool holds: the larger of the largest decode batch's forward and
    (with piecewise prefill graphs) the largest prefill bucket's, plus the latter's buffers;
    + the largest decode batch's logits and room for sampling with a full-vocabulary sort (top-p,
    the worst case; on the sampling rank only) + `other_bytes` held outside the caching allocator
    (symmetric memory) + a draft model's weights, graphs and catch-up activations, which come
    after the model's cache (speculative decoding): reserved as 25% over its weights.
    Other processes' memory is not charged to us, but we never take more than is free.
    """
    config, model, device = runner.config, runner.model, runner.device
    # The largest prefill step the forward strategy replays as graphs (0: none).
    graph_tokens = forward_strategy.max_prefill_tokens if forward_strategy is not None else 0
    other_bytes, sampling_rank = runner.tp.symmetric_memory_bytes(), runner.rank == 0
    draft = config.speculation
    later_bytes = int(1.25 * draft.weight_bytes(config.dtype)) if draft else 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    warmup_forward(model, min(config.max_num_batched_tokens, config.max_num_seqs * config.max_model_len),
                   config.max_model_len, device)
    prefill_peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    warmup_forward(model, config.max_num_seqs, 1, device)
    graph_peak = torch.cuda.max_memory_allocated() - base
    if graph_tokens:  # the pieces share the decode graphs' pool (features/prefill_graphs.py)
        torch.cuda.reset_peak_memory_stats()
        warmup_forward(model, graph_tokens, config.max_model_len, device)
        # Its q/k/v, attention-output and hidden-state buffers: under 8 x hidden_size per token.
        buffers = graph_tokens * config.hf_config.hidden_size * 8 * config.dtype.itemsize
        graph_peak = max(graph_peak, torch.cuda.max_memory_allocated() - base) + buffers
    # Sampling is not run here (that would compile its kernels inside the cold start): its
    # worst case, a full-vocabulary sort for top-p, holds about fp32 logits + sorted values +
    # int64 indices + a cumulative sum per row, ~24 bytes per logit.
    sampler_peak = config.max_num_seqs * config.hf_config.vocab_size * 24 if sampling_rank else 0
    decode_peak = graph_peak + sampler_peak
    logger.info("KV budget charges %.0f MiB for prefill, %.0f MiB for the CUDA graphs, %.0f MiB for sampling",
                prefill_peak / 2**20, graph_peak / 2**20, sampler_peak / 2**20)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    held = base + other_bytes
    budget = total * config.gpu_memory_utilization - held - prefill_peak - decode_peak - later_bytes
    headroom = free - prefill_peak - decode_peak - later_bytes - (256 << 20)
    return int(min(budget, headroom) // per_block)


@torch.inference_mode()
def warmup_forward(model, num_tokens: int, seq_len: int, device: torch.device) -> None:
    """One eager forward over `num_tokens` tokens in sequences of `seq_len`, without a KV
    cache, plus logits of each sequence's last token, to measure memory."""
    num_tokens = max(1, num_tokens)
    seq_len = min(num_tokens, seq_len)
    lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    pos = torch.cat([torch.arange(n, device=device) for n in lens])
    meta = prefill_metadata(lens, lens, torch.full((num_tokens,), -1, dtype=torch.int32), None, device)
    hidden = model(ids, pos, meta)
    last = torch.tensor(lens, device=device).cumsum(0) - 1
    model.compute_logits(hidden[last])
