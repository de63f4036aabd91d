"""Decode steps as captured CUDA graphs: one graph per batch size, replayed on fixed buffers.

A decode step launches hundreds of small kernels; replaying a graph launches them all at once,
so the GPU never waits for the host between them. Graphs are captured for a few batch sizes
(powers of two up to 32, then steps of 32); a step replays the smallest that fits, its padding
rows writing nowhere (slot -1) and attending to nothing (context 0).
"""

from __future__ import annotations

import contextlib
import logging

import torch

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def preferred_blas(name: str):
    """Make torch's CUDA GEMMs use the BLAS library `name` inside the block, then restore."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def graph_batch_sizes(max_bs: int) -> list[int]:
    """Decode batch sizes to capture: powers of two up to 32, then steps of 32, plus `max_bs`."""
    sizes = [b for b in (1, 2, 4, 8, 16) if b < max_bs] + list(range(32, max_bs, 32))
    return sizes + [max_bs]


class DecodeGraphs:
    """The captured decode graphs of one model runner and the hidden-state buffer they write.

    `forward(ids, positions, meta)` is the model's decode forward; `inputs` (StepInputs) holds the
    buffers every graph reads, `input_tokens` picks each row's input token on the device
    (TokenSampler.input_tokens). The graphs' GEMMs are captured with cuBLASLt (a graph keeps
    the kernels it was captured with, so the process-wide choice is switched for the capture
    only: cuBLASLt's picks beat cuBLAS's on most decode shapes).
    """

    def __init__(self, forward, inputs, input_tokens, max_bs: int, hidden_size: int, dtype: torch.dtype):
        self.sizes = graph_batch_sizes(max_bs)
        self.hidden = torch.zeros(max_bs, hidden_size, dtype=dtype, device=inputs.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Batch size -> the (positions, metadata) its graph reads: after a replay, the step's.
        self.inputs_of: dict[int, tuple] = {}
        self.inputs = inputs
        self.pool = None  # the graphs' memory pool and capture stream (the prefill graphs use both)
        self.stream = torch.cuda.Stream()
        with torch.inference_mode(), preferred_blas("cublaslt"):
            self._capture(forward, input_tokens)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def _capture(self, forward, input_tokens) -> None:
        """One graph per size, largest first, so the smaller ones reuse its memory pool."""
        for bs in reversed(self.sizes):
            ids, pos, slots, ctx, src, tables = self.inputs.buffers.views(bs)
            meta = self.inputs.decode_metadata(bs, slots, ctx, tables)
            # Any valid context works for capture: one token in block 0 (slot -1: nothing stored).
            slots.fill_(-1)
            ctx.fill_(1)
            src.fill_(-1)
            tables.fill_(0)
            forward(input_tokens(ids, src), pos, meta)  # warm-up outside the graph (Triton compiles, cuBLAS plans)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, self.pool, stream=self.stream):
                self.hidden[:bs] = forward(input_tokens(ids, src), pos, meta)
            self.pool = graph.pool() if self.pool is None else self.pool
            self.graphs[bs] = graph
            self.inputs_of[bs] = (pos, meta)
            torch.cuda.synchronize()

    def batch_size_for(self, n: int) -> int | None:
        """The smallest captured batch size that holds `n` rows, or None."""
        return next((b for b in self.sizes if b >= n), None)

    def replay(self, step, bs: int) -> torch.Tensor:
        """Run `step` (a StepInput) through the graph of batch size `bs`; its hidden states."""
        self.inputs.buffers.load(step, bs)  # writes straight into the graph's input tensors
        self.graphs[bs].replay()
        return self.hidden[:len(step.token_ids)]
