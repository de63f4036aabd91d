"""Speculative decoding's cost and gain at small batches: decode ms per token of the same greedy
requests without `speculative_config` and with each method asked for, one engine each, in one process.

Two prompt kinds: "random" token ids (prompt lookup rarely matches: what drafting costs when it
misses) and "repeating" ones (a 16-token pattern repeated: matches from the first step, and a
dummy-weight model's greedy output tends to fall into a loop that prompt lookup then follows).
Dummy weights say nothing about real text's acceptance rate; this measures what a verification
step costs against a decode step, and the speed at the acceptance that each workload gets.

    python benchmarks/spec_bench.py --dummy qwen3-8b [--methods ngram eagle3 draft_model] [--k 4]
        [--synthetic 0.7] [--quantization fp8] [--batches 1 4 16] [--kinds random] [--json out.json]
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


def run(path: str, spec: dict | None, batches: list[int], tokens: int, kinds: list[str], quantization=None) -> dict:
    from nanovllm import LLM
    from nanovllm.features.speculative.drafting import draft_counts

    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, speculative_config=spec,
              quantization=quantization)
    out = {}
    for kind in kinds:
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


def configs(args) -> dict[str, dict]:
    """Method name -> speculative_config, for each of --methods."""
    made = {}
    for method in args.methods:
        if method == "ngram":
            spec = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5}
        elif method == "eagle3":  # a head config beside the target's (random weights, like the target's)
            spec = {"method": "eagle3", "model": os.path.join(HERE, DUMMY_CONFIGS[args.dummy] + "-eagle3")}
        else:  # (dummy weights for the draft too: with the target's seed and shapes it drafts its tokens)
            spec = {"method": "draft_model", "model": os.path.join(HERE, DUMMY_CONFIGS[args.draft])}
        spec["num_speculative_tokens"] = args.k
        if args.synthetic is not None:
            spec |= {"rejection_sample_method": "synthetic", "synthetic_acceptance_rate": args.synthetic}
        made[method] = spec
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dummy", choices=sorted(DUMMY_CONFIGS), required=True)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--methods", nargs="+", default=["ngram"], choices=["ngram", "eagle3", "draft_model"],
                    help="eagle3: the head config in benchmarks/configs/<dummy>-eagle3; draft_model: --draft")
    ap.add_argument("--draft", choices=sorted(DUMMY_CONFIGS), default="qwen3-0.6b",
                    help="the draft_model method's dummy draft")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--kinds", nargs="+", default=["random", "repeating"], choices=["random", "repeating"])
    ap.add_argument("--quantization", choices=["fp8"], help="the target's weights (the head / draft: the same)")
    ap.add_argument("--synthetic", type=float, metavar="RATE",
                    help="rejection_sample_method 'synthetic': each draft kept with this probability (random "
                         "weights accept nothing; the tokens are then not the model's)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--json")
    args = ap.parse_args()
    path = os.path.join(HERE, DUMMY_CONFIGS[args.dummy])
    specs = configs(args)
    run_args = (args.batches, args.tokens, args.kinds, args.quantization)
    plain = run(path, None, *run_args)
    drafted = {name: run(path, spec, *run_args) for name, spec in specs.items()}
    print(f"{args.dummy}{' ' + args.quantization if args.quantization else ''}, k={args.k}"
          + (f", synthetic acceptance {args.synthetic}" if args.synthetic is not None else "")
          + " (ms/token; x of plain; mean accepted length)")
    print(f"{'workload':<16}{'plain':>8}" + "".join(f"{name:>28}" for name in drafted))
    for key in plain:
        p = plain[key]["ms_per_token"]
        cells = [f"{d[key]['ms_per_token']:.3f} {d[key]['ms_per_token'] / p:.2f}x "
                 f"{d[key].get('mean_accepted_length')}" for d in drafted.values()]
        print(f"{key:<16}{p:>8.3f}" + "".join(f"{c:>28}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.dummy, "quantization": args.quantization, "k": args.k, "configs": specs,
                       "plain": plain, "speculative": drafted}, f, indent=1)


if __name__ == "__main__":
    main()
