"""Prefills behind a cached prefix, through the whole engine: --seqs requests sharing a
--cached-token prefix (already in the prefix cache) each add --new fresh tokens and generate one
token. What a chat server sees when many conversations share a system prompt; the attention
of those steps reads every request's cached context (benchmarks/kernels/bench_paged_prefill.py
times that kernel alone).

Each round uses new suffixes (no request hits another's), after one untimed round; the figure
is the median of --rounds, in ms and new tokens per second. Run the same command on both sides
of an A/B in one device call:

    python benchmarks/bench_prefix_prefill.py --dummy qwen3-0.6b --scenario 64,1024,32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import bench  # noqa: E402


def one_round(llm, prefix: list[int], seqs: int, new: int, gen: torch.Generator, vocab: int) -> float:
    """Seconds for `seqs` prompts of prefix + `new` fresh tokens, one output token each."""
    from nanovllm import SamplingParams

    prompts = [prefix + torch.randint(0, vocab, (new,), generator=gen).tolist() for _ in range(seqs)]
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dummy", default="qwen3-0.6b", choices=sorted(bench.DUMMY_CONFIGS))
    ap.add_argument("--scenario", action="append", default=None,
                    help="seqs,cached,new (repeatable; default 64,1024,32 and 16,4096,256)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    scenarios = [tuple(map(int, s.split(","))) for s in (args.scenario or ["64,1024,32", "16,4096,256"])]

    from nanovllm import LLM

    longest = max(c + n for _, c, n in scenarios)
    llm = LLM(os.path.join(os.path.dirname(bench.__file__), bench.DUMMY_CONFIGS[args.dummy]), load_format="dummy",
              skip_tokenizer_init=True, max_model_len=longest + 16, kv_cache_dtype=args.kv_cache_dtype)
    vocab = min(llm.config.hf_config.vocab_size, 10_000)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for seqs, cached, new in scenarios:
        prefix = torch.randint(0, vocab, (cached,), generator=gen).tolist()
        one_round(llm, prefix, 1, new, gen, vocab)  # the prefix into the cache
        one_round(llm, prefix, seqs, new, gen, vocab)  # warm-up
        times = [one_round(llm, prefix, seqs, new, gen, vocab) for _ in range(args.rounds)]
        ms = statistics.median(times) * 1e3
        rows.append({"seqs": seqs, "cached": cached, "new": new, "ms": round(ms, 2),
                     "new_tok_s": round(seqs * new / ms * 1e3), "rounds_ms": [round(t * 1e3, 2) for t in times]})
        print(f"{seqs} x ({cached} + {new}): {ms:.2f} ms a round, {rows[-1]['new_tok_s']:,} new tok/s", flush=True)
    llm.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.dummy, "kv_cache_dtype": args.kv_cache_dtype, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
