"""Where a big prefill step's time goes: host launch time against GPU time, and the calls that
synchronize the host with the GPU inside it.

    PYTHONPATH=. python3 benchmarks/probe_prefill_host.py [--dummy qwen3-0.6b] [--tokens 16384]

Runs fresh prompts of ~560 tokens (the bench workload's mean) filling one step of --tokens, with
max_tokens=1, on dummy weights. Prints: the wall time of one such generate; the device time of its
kernels (torch.profiler); the host's self time by op, top 25; the device time by kernel, top 15;
every op torch reports as synchronizing (torch.cuda.set_sync_debug_mode) with the Python line
that called it. On CPU (--model a checkpoint folder) only the first three.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from nanovllm import LLM, SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))


def prompts(n_tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out, left = [], n_tokens
    while left > 0:
        n = min(left, rng.randint(100, 1024))
        out.append([rng.randint(0, 10000) for _ in range(n)])
        left -= n
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dummy", default="qwen3-0.6b")
    ap.add_argument("--model", help="a checkpoint folder instead of --dummy's shape (its own weights)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--prefill-graph-tokens", type=int, default=None)
    args = ap.parse_args()
    extra = {} if args.prefill_graph_tokens is None else {"max_prefill_graph_tokens": args.prefill_graph_tokens}
    path = args.model or os.path.join(HERE, "configs", args.dummy)
    llm = LLM(path, load_format="auto" if args.model else "dummy", skip_tokenizer_init=True,
              max_model_len=4096, max_num_batched_tokens=args.tokens, **extra)
    cuda = torch.cuda.is_available()
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1)
    llm.generate(prompts(args.tokens, 0), params, use_tqdm=False)  # warm-up: same shapes
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    walls = []
    for seed in (1, 2, 3):
        t = time.perf_counter()
        llm.generate(prompts(args.tokens, seed), params, use_tqdm=False)
        sync()
        walls.append(time.perf_counter() - t)
    print(f"wall ms of one {args.tokens}-token prefill generate: {[round(w * 1e3, 1) for w in walls]}")

    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        llm.generate(prompts(args.tokens, 4), params, use_tqdm=False)
        sync()
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    print(f"device kernel time: {device_us / 1e3:.1f} ms")
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    if cuda:
        print("device time by kernel")
        print(events.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))

    if not cuda:
        return
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm.generate(prompts(args.tokens, 5), params, use_tqdm=False)
    torch.cuda.set_sync_debug_mode("default")
    where = collections.Counter(f"{w.filename}:{w.lineno}: {str(w.message)[:80]}" for w in caught)
    print(f"synchronizing calls in one prefill generate: {sum(where.values())}")
    for line, n in where.most_common(20):
        print(f"  {n:5d}  {line}")


if __name__ == "__main__":
    main()
