"""What an arriving request costs a server's engine: the mixed step that prefills its prompt.

Drives one LLM with the server's options (mixed steps): --rows requests decoding, then one
--prompt-tokens prompt (max_tokens 1) arrives, --arrivals times. For each arrival it times the
mixed step's launch from an idle GPU (host time; then until the GPU is done) and, in steady
state, `step()` of the mixed step plus the one after it (two decode steps take ~2x a decode
step). With the piecewise prefill graphs it also interleaves, in the same process, rounds with
the mixed steps' decode rows attended eagerly (the pieces' decode-row tables left empty, as for
a step that does not fit them): the A/B of engine/prefill_graphs.py's decode rows in the pieces.
The host's speed drifts between processes, so only an A/B in one process means much.

    python benchmarks/bench_mixed_step.py --dummy qwen3-0.6b
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import bench  # noqa: E402
from nanovllm import SamplingParams  # noqa: E402


@contextlib.contextmanager
def eager_decode_rows(llm, enabled: bool):
    """While enabled: the prefill graphs' buckets hold no decode rows, so a mixed step's decode
    rows attend eagerly between the pieces (its decode-row tables stay empty)."""
    graphs = getattr(llm.model_runner.forward_strategy, "graphs", None)
    if not enabled or graphs is None:
        yield
        return
    saved = {n: b.decode_rows for n, b in graphs.buckets.items()}
    for b in graphs.buckets.values():
        b.decode_rows = -1 if b.decode_rows else 0  # (-1: "has rows, none fit", the fallback path)
    try:
        yield
    finally:
        for n, b in graphs.buckets.items():
            b.decode_rows = saved[n]


def sync(llm) -> None:
    if llm.model_runner.device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--dummy", default="qwen3-0.6b", choices=sorted(bench.DUMMY_CONFIGS),
                     help="real model shape, random weights (default)")
    src.add_argument("--model", help="checkpoint folder instead (its own weights)")
    ap.add_argument("--rows", type=int, default=63, help="requests decoding when a prompt arrives")
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--context", type=int, default=700, help="prompt tokens of the decoding requests")
    ap.add_argument("--arrivals", type=int, default=8, help="arrivals per round")
    ap.add_argument("--rounds", type=int, default=8, help="rounds of each variant, interleaved")
    ap.add_argument("--server-args", default="", help="more server flags (LLM options), one string")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import shlex

    from nanovllm import LLM
    from nanovllm.serve.cli import build_parser, llm_options

    path = args.model or os.path.join(os.path.dirname(bench.__file__), bench.DUMMY_CONFIGS[args.dummy])
    flags = ([] if args.model else ["--load-format", "dummy", "--skip-tokenizer-init"]) + shlex.split(args.server_args)
    llm = LLM(path, **llm_options(build_parser().parse_args([path, *flags])))
    g = torch.Generator().manual_seed(0)
    vocab = min(llm.config.hf_config.vocab_size, 10_000)

    def prompt(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    arrival = SamplingParams(max_tokens=1, ignore_eos=True)
    for _ in range(args.rows):
        llm.add_request(prompt(args.context), SamplingParams(max_tokens=10**6, ignore_eos=True, temperature=0.6))
    for _ in range(20):
        llm.step()
    graphs = getattr(llm.model_runner.forward_strategy, "graphs", None)
    variants = ["decode rows in pieces", "eager decode rows"] if graphs is not None and any(
        b.decode_rows for b in graphs.buckets.values()) else ["as configured"]
    results = {}
    for name in variants:  # warm-up: compiles and first replays of the shapes the arrivals use
        with eager_decode_rows(llm, name == "eager decode rows"):
            for _ in range(3):
                llm.add_request(prompt(args.prompt_tokens), arrival)
                llm.step(), llm.step(), llm.step()
        results[name] = {"launch_ms": [], "until_done_ms": [], "mixed_and_next_ms": []}
    for r in range(args.rounds):
        for name in (variants if r % 2 == 0 else variants[::-1]):
            res = results[name]
            with eager_decode_rows(llm, name == "eager decode rows"):
                for _ in range(args.arrivals):
                    llm.step(), llm.step()
                    llm.add_request(prompt(args.prompt_tokens), arrival)
                    t = time.perf_counter()
                    llm.step(), llm.step()
                    res["mixed_and_next_ms"].append((time.perf_counter() - t) * 1e3)
                    llm.step(), llm.step()
                    sync(llm)  # from an idle GPU: the launch's host time, then the GPU's remainder
                    llm.add_request(prompt(args.prompt_tokens), arrival)
                    t = time.perf_counter()
                    llm.step()
                    res["launch_ms"].append((time.perf_counter() - t) * 1e3)
                    sync(llm)
                    res["until_done_ms"].append((time.perf_counter() - t) * 1e3)
    llm.shutdown()
    report = {"rows": args.rows, "prompt_tokens": args.prompt_tokens, "variants": {}}
    print(f"{args.rows} decoding rows, a {args.prompt_tokens}-token prompt arriving; medians (ms):")
    print(f"{'variant':<24}{'launch (host)':>15}{'until done':>12}{'mixed + next':>14}")
    for name, res in results.items():
        med = {k: round(statistics.median(v), 3) for k, v in res.items()}
        report["variants"][name] = {**med, "n": len(res["launch_ms"])}
        print(f"{name:<24}{med['launch_ms']:>15.3f}{med['until_done_ms']:>12.3f}{med['mixed_and_next_ms']:>14.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": bench.gpu_name(), "commit": bench.git_commit(), **report}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
