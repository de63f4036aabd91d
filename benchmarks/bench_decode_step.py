"""Where a decode step's time goes at the batch sizes a server runs (16-256 rows).

Drives one LLM step by step: B requests with prompts of --context tokens are prefilled, then
decode steps are timed in steady state (wall time between step ends, every row decoding), and
one batch size's steps are profiled kernel by kernel. Against each step, its byte floor: the
weights once plus every row's K/V over --bandwidth.

    python benchmarks/bench_decode_step.py --dummy qwen3-0.6b --sizes 16,32,48,64,128,256 --profile-bs 48
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import bench  # noqa: E402
from nanovllm import SamplingParams  # noqa: E402


def run_steps(llm, count: int) -> list[float]:
    """`count` engine steps; the seconds between consecutive step ends."""
    out, last = [], time.perf_counter()
    for _ in range(count):
        llm.step()
        now = time.perf_counter()
        out.append(now - last)
        last = now
    return out


def start_decoding(llm, batch: int, context: int, steps: int, seed: int):
    """B requests of `context`-token prompts, stepped until every one decodes."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=steps)
    seqs = [llm.add_request(torch.randint(0, 10_000, (context,), generator=g).tolist(), params) for _ in range(batch)]
    for _ in range(1000):
        llm.step()
        if all(s.num_completion_tokens >= 2 for s in seqs):
            return seqs
    raise RuntimeError("requests did not start decoding")


def finish(llm, seqs) -> None:
    for s in seqs:
        if not s.is_finished:
            llm.abort(s)
    while llm.has_unfinished():
        llm.step()


def load(args):
    """The LLM of the run: a checkpoint's own weights (--model) or dummy weights of a real shape."""
    from nanovllm import LLM

    common = dict(skip_tokenizer_init=True, max_model_len=args.max_model_len, max_num_seqs=256,
                  quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    if args.model:
        return LLM(args.model, **common)
    return LLM(os.path.join(os.path.dirname(bench.__file__), bench.DUMMY_CONFIGS[args.dummy]), load_format="dummy",
               max_num_batched_tokens=16384, **common)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--dummy", default="qwen3-0.6b", choices=sorted(bench.DUMMY_CONFIGS),
                     help="real model shape, random weights (default)")
    src.add_argument("--model", help="checkpoint folder instead (its own weights)")
    ap.add_argument("--sizes", default="16,32,48,64,96,128,256")
    ap.add_argument("--context", type=int, default=1000, help="prompt tokens of every request")
    ap.add_argument("--steps", type=int, default=60, help="timed decode steps per batch size")
    ap.add_argument("--profile-bs", type=int, default=0, help="profile this batch size's steps (0: none)")
    ap.add_argument("--bandwidth", type=float, default=4.3e12)
    ap.add_argument("--quantization", help='LLM(quantization=...): "fp8", or "gptq" / "awq" (dummy INT4)')
    ap.add_argument("--kv-cache-dtype", default="auto", help='LLM(kv_cache_dtype=...)')
    ap.add_argument("--max-model-len", type=int, default=4096,
                    help="LLM(max_model_len=...): the block tables' width, hence the decode kernel's splits")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the KV budget's charges
    llm = load(args)
    opts = bench.decoder_options(llm.config.hf_config)
    kv_elem, linear_elem = bench.weight_element_bytes(llm)
    kv_bytes = 2 * opts.num_layers * opts.num_kv_heads * opts.head_dim * kv_elem  # K and V, every layer
    weight_bytes = bench.weight_bytes_per_step(opts, llm.config.dtype.itemsize, linear_bytes=linear_elem)
    pool_mib = llm.model_runner.graph_pool_bytes / 2**20
    print(f"CUDA graphs reserved {pool_mib:.0f} MiB (the KV budget's charge is logged above)")
    rows = []
    for bs in [int(s) for s in args.sizes.split(",")]:
        seqs = start_decoding(llm, bs, args.context, 2 * args.steps + 20, seed=bs)
        run_steps(llm, 5)
        secs = sorted(run_steps(llm, args.steps))
        kept = secs[: max(1, int(0.9 * len(secs)))]  # drop the slowest tenth (stray host hiccups)
        ms = sum(kept) / len(kept) * 1e3
        # Mean context of the timed steps: the prompt, the 2 tokens start_decoding waited for, the
        # step already in flight (overlap scheduling), the 5 warm-up steps, then half the timed ones.
        ctx = args.context + 2 + 1 + 5 + args.steps / 2
        floor = (weight_bytes + bs * ctx * kv_bytes) / args.bandwidth * 1e3
        row = {"batch": bs, "ms_per_step": round(ms, 3), "p50_ms": round(secs[len(secs) // 2] * 1e3, 3),
               # (significant figures, not decimals: a tiny test model's floor is ~1 us, its share ~1e-4)
               "floor_ms": float(f"{floor:.4g}"), "of_floor": float(f"{floor / ms:.3g}"), "tok_s": round(bs / ms * 1e3)}
        if bs == args.profile_bs:
            row["profile"] = profile_steps(llm, args.steps)
        rows.append(row)
        finish(llm, seqs)
    llm.shutdown()
    print(f"{'batch':>6}{'ms/step':>9}{'p50':>8}{'floor':>8}{'of floor':>10}{'tok/s':>9}")
    for r in rows:
        print(f"{r['batch']:>6}{r['ms_per_step']:>9.3f}{r['p50_ms']:>8.3f}{r['floor_ms']:>8.3f}{r['of_floor']:>10.1%}"
              f"{r['tok_s']:>9}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": bench.gpu_name(), "commit": bench.git_commit(), "context": args.context,
                       "graph_pool_mib": round(pool_mib), "rows": rows},
                      f, indent=1)


def profile_steps(llm, steps: int) -> dict:
    """Kernel time per decode step (mean over `steps`), by kernel name and by kind."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t = time.perf_counter()
        run_steps(llm, steps)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    kernels = bench.profiled_kernels(prof)
    by_name: dict[str, list] = {}
    for name, us in kernels:
        g = by_name.setdefault(name, [0, 0.0])
        g[0] += 1
        g[1] += us
    busy = sum(us for _, us in kernels)
    print(f"profiled {steps} steps: wall {wall / steps * 1e3:.3f} ms/step, kernels {busy / steps / 1e3:.3f} ms/step, "
          f"{len(kernels) / steps:.0f} kernels/step")
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:40]
    for name, (n, us) in top:
        print(f"  {us / steps:>8.1f} us {n / steps:>6.1f}x  {name[:110]}")
    kinds = bench.kernel_breakdown(kernels)
    for kind, s in kinds.items():
        print(f"  {kind:<32}{s / steps * 1e6:>9.1f} us/step")
    return {"wall_ms": round(wall / steps * 1e3, 3), "kernel_ms": round(busy / steps / 1e3, 3),
            "kernels_per_step": round(len(kernels) / steps, 1),
            "top": [[name[:110], round(n / steps, 1), round(us / steps, 1)] for name, (n, us) in top],
            "kinds_us": {k: round(s / steps * 1e6, 1) for k, s in kinds.items()}}


if __name__ == "__main__":
    main()
