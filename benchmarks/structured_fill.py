"""xgrammar's host cost per step on this machine's CPU, for structured_bench.py's schema and
tokenizers: `rows` matchers each take a random allowed token a step (as dummy weights sample),
and every step is timed: the batched mask fill, and the batched accept.

    python benchmarks/structured_fill.py [--vocab-file qwen.tiktoken] [--rows 256] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from structured_bench import SCHEMA, model_folder  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab-file")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", default="auto")
    args = ap.parse_args()
    import xgrammar as xgr
    from transformers import AutoTokenizer

    folder = model_folder("qwen3-0.6b", 151_643, args.vocab_file)
    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(folder), vocab_size=151_936)
    grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    matchers = [xgr.GrammarMatcher(grammar) for _ in range(args.rows)]
    batch = xgr.BatchGrammarMatcher(args.threads if args.threads == "auto" else int(args.threads))
    mask = xgr.allocate_token_bitmask(args.rows, 151_936)
    rng = np.random.default_rng(0)
    fill = accept = 0.0
    for _ in range(args.steps):
        t = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, mask)
        fill += time.perf_counter() - t
        bits = np.unpackbits(mask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :info.vocab_size]
        tokens = [int(rng.choice(np.flatnonzero(row))) for row in bits]
        t = time.perf_counter()
        batch.batch_accept_token(matchers, tokens)
        accept += time.perf_counter() - t
    per = 1e3 / args.steps
    print(f"{'qwen.tiktoken' if args.vocab_file else 'random BPE'}: fill {fill * per:.2f} ms a step "
          f"({fill * per * 1e3 / args.rows:.1f} us a row), accept {accept * per:.2f} ms a step, "
          f"{args.rows} rows, threads {args.threads}, {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
