"""Speculative decoding's cost and gain at small batches: decode ms per token of the same greedy
requests with and without `speculative_config` (n-gram), one engine each, in one process.

Two prompt kinds: "random" token ids (prompt lookup rarely matches: what drafting costs when it
misses) and "repeating" ones (a 16-token pattern repeated: matches from the first step, and a
dummy-weight model's greedy output tends to fall into a loop that prompt lookup then follows).
Dummy weights say nothing about real text's acceptance rate; this measures what a verification
step costs against a decode step, and the speed at the acceptance that each workload gets.

    python benchmarks/spec_bench.py --dummy qwen3-8b [--k 4] [--batches 1 4 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import DUMMY_CONFIGS, HERE  # noqa: E402


def prompts_of(kind: str, batch: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    if kind == "random":
        return [[rng.randrange(10000) for _ in range(256)] for _ in range(batch)]
    return [[rng.randrange(10000) for _ in range(16)] * 16 for _ in range(batch)]


def ms_per_token(llm, prompts, tokens: int) -> float:
    """Decode ms per generated token of one generate (the prompt step's time taken out)."""
    from nanovllm import SamplingParams

    first = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
    whole = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=tokens + 1)
    # Warm: the prompts' prefix cache, and every kernel variant the run launches compiled (a
    # verification step's attention and sampling shapes are new to a fresh engine).
    llm.generate(prompts, whole, use_tqdm=False)
    t = time.perf_counter()
    llm.generate(prompts, first, use_tqdm=False)
    t_first = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate(prompts, whole, use_tqdm=False)
    return (time.perf_counter() - t - t_first) / tokens * 1e3


def run(path: str, spec: dict | None, batches: list[int], tokens: int) -> dict:
    from nanovllm import LLM
    from nanovllm.features.speculative.drafting import draft_counts

    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, speculative_config=spec)
    out = {}
    for kind in ("random", "repeating"):
        for b in batches:
            counts = draft_counts(llm.scheduler)
            before = (counts.num_drafts, counts.num_accepted_tokens) if counts else (0, 0)
            ms = ms_per_token(llm, prompts_of(kind, b, b), tokens)
            row = {"ms_per_token": round(ms, 3), "tok_s": round(b / ms * 1e3, 1)}
            if counts is not None:
                drafts, accepted = counts.num_drafts - before[0], counts.num_accepted_tokens - before[1]
                row["mean_accepted_length"] = round(1 + accepted / drafts, 2) if drafts else None
            out[f"{kind}-bs{b}"] = row
    llm.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dummy", choices=sorted(DUMMY_CONFIGS), required=True)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--draft", choices=sorted(DUMMY_CONFIGS),
                    help="the draft_model method with this dummy model as the draft (default: n-gram)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--synthetic", type=float, metavar="RATE",
                    help="rejection_sample_method 'synthetic': each draft kept with this probability (random "
                         "weights accept nothing; the tokens are then not the model's)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--json")
    args = ap.parse_args()
    path = os.path.join(HERE, DUMMY_CONFIGS[args.dummy])
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    if args.draft:  # (dummy weights for the draft too: the same seed and shapes draft the target's tokens)
        spec = {"method": "draft_model", "model": os.path.join(HERE, DUMMY_CONFIGS[args.draft]),
                "num_speculative_tokens": args.k}
    if args.synthetic is not None:
        spec |= {"rejection_sample_method": "synthetic", "synthetic_acceptance_rate": args.synthetic}
    plain, drafted = run(path, None, args.batches, args.tokens), run(path, spec, args.batches, args.tokens)
    print(f"{args.dummy}, {spec['method']} {args.draft or ''} k={args.k}"
          + (f", synthetic acceptance {args.synthetic}" if args.synthetic is not None else ""))
    print(f"{'workload':<16}{'plain ms/tok':>14}{'spec ms/tok':>13}{'speedup':>9}{'accepted len':>14}")
    for key in plain:
        p, s = plain[key], drafted[key]
        print(f"{key:<16}{p['ms_per_token']:>14.3f}{s['ms_per_token']:>13.3f}"
              f"{p['ms_per_token'] / s['ms_per_token']:>9.2f}{str(s.get('mean_accepted_length')):>14}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.dummy, "k": args.k, "speculative_config": spec, "plain": plain,
                       "speculative": drafted}, f, indent=1)


if __name__ == "__main__":
    main()
