"""Sampler.forward with top-k / top-p / min-p (the sort-free filter kernels) against plain temperature.

    PYTHONPATH=. python3 benchmarks/kernels/bench_sampler.py [--iters 50] [--logits randn peaked]

bf16 logits [B, 151936] (Qwen3's vocabulary) for B = 64 and 256, temperature 0.6 on every row.
Each filter mix runs through Sampler() eagerly, as the engine calls it; CUDA events around each
call after a warm-up, the median of --iters calls, each with new offsets (new noise). Prints ms
and ms over plain temperature sampling. (The older sorting route this was once compared with is
in git history; its numbers are in BENCHMARKS.md.)

Logits: randn is N(0, 2^2), flat: many tokens near the top, the worst case for top-p's rejection
rounds and for skipping noise; peaked adds 6-12 to 8 random tokens per row, closer to a model's.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

VOCAB, TEMPERATURE = 151_936, 0.6
BATCHES = (64, 256)
CASES = {
    "temperature": {},
    "temperature, 1/4 greedy": None,  # every 4th row greedy (the filter kernel's route too)
    "top_p=0.95": dict(top_p=0.95),
    "top_k=20 top_p=0.95": dict(top_k=20, top_p=0.95),
    "min_p=0.05": dict(min_p=0.05),
    "top_k=20 top_p=0.95 min_p=0.05": dict(top_k=20, top_p=0.95, min_p=0.05),
}


def make_logits(kind: str, b: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(b, VOCAB, device="cuda", generator=gen) * 2
    if kind == "peaked":
        top = torch.randint(0, VOCAB, (b, 8), device="cuda", generator=gen)
        x.scatter_add_(1, top, torch.rand(b, 8, device="cuda", generator=gen) * 6 + 6)
    return x.to(torch.bfloat16)


def sampling_tensors(case: str, b: int):
    from nanovllm.core.sampler import SamplingTensors
    from nanovllm.sampling_params import SamplingParams

    kw = CASES[case]
    params = [SamplingParams(temperature=0.0 if kw is None and i % 4 == 0 else TEMPERATURE, **(kw or {}))
              for i in range(b)]
    return SamplingTensors.build(params, list(range(b)), [1000] * b, "cuda")


def median_ms(sampler, logits: torch.Tensor, t, iters: int) -> tuple[float, list[torch.Tensor]]:
    """Median ms of sampler(logits, t) over `iters` calls with offsets +0, +1, ..., and the tokens."""
    runs = [dataclasses.replace(t, offsets=t.offsets + i) for i in range(iters)]
    for r in runs[:3]:
        sampler(logits, r)  # warm-up (Triton compiles)
    torch.cuda.synchronize()
    times, tokens = [], []
    for r in runs:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        tokens.append(sampler(logits, r))
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--logits", nargs="+", choices=["randn", "peaked"], default=["randn", "peaked"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_sampler: needs a CUDA GPU; nothing to do here")
        return
    from nanovllm.core.triton_sampler import TritonSampler

    sampler = TritonSampler()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'B':>4} {'logits':<7} {'case':<32}{'ms':>8}{'-temp':>8}")
    for b in BATCHES:
        for kind in args.logits:
            logits = make_logits(kind, b, gen)
            base = None
            for case in CASES:
                ms, _ = median_ms(sampler, logits, sampling_tensors(case, b), args.iters)
                base = ms if base is None else base
                print(f"{b:>4} {kind:<7} {case:<32}{ms:>8.3f}{ms - base:>8.3f}", flush=True)

if __name__ == "__main__":
    main()
