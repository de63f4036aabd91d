"""The host cost a step of structured outputs' mask extension itself (features/structured/
masks.py, the engine's code), on this machine's CPU: `rows` sequences held to structured_bench.py's
schema each take a random allowed token a step; timed are prepare (the engine's thread) and the
worker's part (advance the matchers, fill the bitmask) until its result.

    python benchmarks/structured_host.py [--vocab-file qwen.tiktoken] [--rows 256] [--steps 100]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from structured_bench import SCHEMA, model_folder  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab-file")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    import torch
    from transformers import AutoTokenizer

    from nanovllm import SamplingParams
    from nanovllm.core.sequence import Sequence
    from nanovllm.features.structured.grammars import Grammars
    from nanovllm.features.structured.masks import StructuredOutputs
    from nanovllm.sampling_params import StructuredOutputsParams

    tokenizer = AutoTokenizer.from_pretrained(model_folder("qwen3-0.6b", 151_643, args.vocab_file))
    vocab = 151_936
    ext = StructuredOutputs(Grammars(tokenizer, vocab, {tokenizer.eos_token_id}), torch.device("cpu"), False,
                            lambda: None)
    params = SamplingParams(max_tokens=10_000, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    seqs = [Sequence(i, [1, 2, 3], params, seed=i) for i in range(args.rows)]
    state = ext.build(seqs, list(range(args.rows)), vocab)
    rng = np.random.default_rng(0)
    prepare = worker = 0.0
    with torch.inference_mode():
        for _ in range(args.steps):
            t0 = time.perf_counter()
            ext.prepare(state)
            t1 = time.perf_counter()
            state.filled.result()
            t2 = time.perf_counter()
            prepare, worker = prepare + t1 - t0, worker + t2 - t1
            bits = np.unpackbits(state.host.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
            for seq, row in zip(seqs, bits):
                seq.token_ids.append(int(rng.choice(np.flatnonzero(row))))
    per = 1e3 / args.steps
    print(f"{'qwen.tiktoken' if args.vocab_file else 'random BPE'}, {args.rows} rows: prepare {prepare * per:.2f} ms "
          f"a step, worker (advance + fill) {worker * per:.2f} ms a step, {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
