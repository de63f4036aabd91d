"""Sweep of the Triton paged-decode kernel's KV split count against choose_num_splits' pick.

    PYTHONPATH=. python3 benchmarks/kernels/bench_paged_decode.py [--json out.json]

For batch sizes 1-256, 8 and 4 kv heads (Qwen3-8B at TP=1 and TP=2) and a few context-length
ranges, times every split count (CUDA graph of 20 calls) and prints the best one next to the
rule's. Block size 256, head_dim 128, 4 query heads per kv head, bf16.
"""

from __future__ import annotations

import argparse
import json

import torch

from nanovllm.kernels.paged_decode import choose_num_splits, paged_decode_attention
from timing import cuda_graph_us, random_paged_batch  # benchmarks/kernels/timing.py (this folder)

BLOCK, HEAD_DIM, GROUP = 256, 128, 4
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
# (batch sizes, table width in blocks, context range): the bench workload's decode phase
# (256 sequences, 100-2,000 tokens), then fewer and longer sequences.
CASES = [
    ((256, 192, 128), 16, (100, 1100)),
    ((256, 192, 128, 96, 64), 16, (500, 2000)),
    ((64, 48, 32, 24, 16), 16, (1000, 4000)),
    ((16, 8, 4, 2, 1), 64, (4000, 16000)),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write every measurement here")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{'B':>4}{'kvh':>4}{'ctx':>12}{'best':>6}{'us':>8}{'rule':>6}{'us':>8}{'loss':>7}")
    for batches, width, (lo, hi) in CASES:
        for kvh in (8, 4):
            for batch in batches:
                q, k, v, tables, ctx = random_paged_batch(batch, kvh, width, (lo, hi), gen, BLOCK, HEAD_DIM, GROUP)
                times = {s: cuda_graph_us(lambda: paged_decode_attention(q, k, v, tables, ctx, HEAD_DIM ** -0.5, s))
                         for s in SPLITS if s <= width}
                best = min(times, key=times.get)
                rule = choose_num_splits(batch, kvh, width, num_sms=sms)
                rule_us = times.get(rule) or cuda_graph_us(lambda: paged_decode_attention(q, k, v, tables, ctx, HEAD_DIM ** -0.5, rule))
                print(f"{batch:>4}{kvh:>4}{f'{lo}-{hi}':>12}{best:>6}{times[best]:>8.1f}{rule:>6}{rule_us:>8.1f}"
                      f"{rule_us / times[best] - 1:>7.1%}")
                rows.append({"batch": batch, "kv_heads": kvh, "width": width, "ctx": [lo, hi], "rule": rule,
                             "rule_us": rule_us, "us": {str(s): t for s, t in times.items()}})
                del k, v
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
