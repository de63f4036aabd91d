"""Shared by the kernel microbenchmarks in this folder."""

from __future__ import annotations

import statistics

import torch


def cuda_graph_us(fn, calls: int = 20, replays: int = 10, before_timing=None, median: bool = False) -> float:
    """Microseconds per call of `fn`, replayed from a CUDA graph of `calls` calls, so that
    launch gaps are those of the engine's decode graphs, not of Python. `fn` runs eagerly once
    first (Triton compiles outside the capture); `before_timing` runs just before the clock
    starts (a barrier, for collectives). The mean over `replays` replays, or with `median` the
    median of the replays timed one by one (a stray slow replay then does not count)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    if before_timing is not None:
        before_timing()
    times = []
    for _ in range(1 if not median else replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays if not median else 1):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (calls * (replays if not median else 1)))
    return statistics.median(times)


def random_paged_batch(batch: int, kv_heads: int, width: int, ctx_range: tuple[int, int], gen: torch.Generator,
                       block: int = 256, head_dim: int = 128, group: int = 4):
    """Random decode-attention inputs in bf16 on the GPU: (q, k_cache, v_cache, block_tables,
    context_lens) for `batch` sequences of `width` blocks each (shuffled over the cache) and
    context lengths drawn from [lo, hi)."""
    blocks = batch * width
    k = torch.randn(blocks, block, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, group * kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(blocks, device="cuda", generator=gen).to(torch.int32).view(batch, width)
    ctx = torch.randint(*ctx_range, (batch,), device="cuda", generator=gen, dtype=torch.int32)
    return q, k, v, tables, ctx


# Qwen3-8B's sizes, for the GEMM and all-reduce microbenchmarks.
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 4096, 12288, 32, 8, 128


def qwen3_8b_gemms(tp: int) -> list[tuple[str, int, int]]:
    """(name, K, N) of each decoder-layer GEMM on one of `tp` ranks; o and down are the
    row-parallel ones (N = HIDDEN, their outputs are all-reduced)."""
    return [("qkv", HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM // tp), ("o", HEADS * HEAD_DIM // tp, HIDDEN),
            ("gate_up", HIDDEN, 2 * INTER // tp), ("down", INTER // tp, HIDDEN)]


def row_parallel_gemms(tp: int) -> list[tuple[str, int]]:
    """(name, K) of qwen3_8b_gemms' row-parallel GEMMs (N = HIDDEN)."""
    return [(name, k) for name, k, n in qwen3_8b_gemms(tp) if name in ("o", "down")]
