"""Sweep of the Triton paged-decode kernel's KV split count against choose_num_splits' pick.

    PYTHONPATH=. python3 benchmarks/kernels/bench_paged_decode.py [--json out.json] [--kv-fp8] [--tile N]
        [--case BATCHES:WIDTH:LO-HI ...] [--group G] [--kv-heads H,...]

For batch sizes 1-256, 8 and 4 kv heads (Qwen3-8B at TP=1 and TP=2) and a few context-length
ranges, times every split count (CUDA graph of 20 calls) and prints the best one next to the
rule's. Block size 256, head_dim 128, 4 query heads per kv head, bf16.

--kv-fp8: the same sweep over an FP8 (e4m3) cache with bf16 q, plus the bf16 cache's time at
its rule's split count and the FP8/bf16 ratio (FP8 reads half the bytes, so ~0.5 is the
memory-bound ideal). --tile N: the FP8 kernel's tokens per tile instead of the default
(_launch_config's: q's, 64 tokens at head_dim 128 in bf16; 128 fetches as many bytes per tile as
bf16 does, but spilled registers when compiled for sm_90 on the CPU).

--case (repeatable) replaces the cases below, e.g. Qwen3-0.6B's batch-1 step after a 1,000-token
prompt: --case 1:16:900-1100 --group 2 --kv-heads 8 (16 query and 8 kv heads).
"""

from __future__ import annotations

import argparse
import json

import torch

from nanovllm.kernels import paged_decode
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


def decode_us(q, k, v, tables, ctx, splits, scales=None, tile=None) -> float:
    """Microseconds per paged_decode_attention call (CUDA-graph replay); `scales` for an FP8
    cache; `tile` overrides the kernel's tokens per tile (a benchmark-only patch of
    _launch_config, in force while the graph is captured)."""
    kw = {"k_scale": scales[0], "v_scale": scales[1]} if scales else {}
    fn = lambda: paged_decode_attention(q, k, v, tables, ctx, HEAD_DIM ** -0.5, splits, **kw)  # noqa: E731
    default = paged_decode._launch_config
    if tile:
        paged_decode._launch_config = lambda head_dim, elem_size, fp8=False: (
            tile, *default(head_dim, elem_size, fp8)[1:])
    try:
        return cuda_graph_us(fn)
    finally:
        paged_decode._launch_config = default


def parse_case(text: str) -> tuple:
    """BATCHES:WIDTH:LO-HI (e.g. 1,2:16:900-1100) as a CASES entry."""
    try:
        batches, width, span = text.split(":")
        lo, hi = span.split("-")
        return tuple(int(b) for b in batches.split(",")), int(width), (int(lo), int(hi))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--case wants BATCHES:WIDTH:LO-HI (e.g. 1,2:16:900-1100), "
                                         f"got {text!r}") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write every measurement here")
    ap.add_argument("--kv-fp8", action="store_true", help="sweep an FP8 cache, and compare with bf16")
    ap.add_argument("--tile", type=int, help="tokens per tile of the swept kernel (with --kv-fp8: of the FP8 one)")
    ap.add_argument("--case", action="append", type=parse_case, help="BATCHES:WIDTH:LO-HI, e.g. 1,2:16:900-1100")
    ap.add_argument("--group", type=int, default=GROUP, help="query heads per kv head")
    ap.add_argument("--kv-heads", default="8,4", help="kv head counts to sweep")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    fp8_cols = f"{'bf16 us':>9}{'fp8/bf16':>9}" if args.kv_fp8 else ""
    print(f"{'B':>4}{'kvh':>4}{'ctx':>12}{'best':>6}{'us':>8}{'rule':>6}{'us':>8}{'loss':>7}{fp8_cols}")
    for batches, width, (lo, hi) in args.case or CASES:
        for kvh in map(int, args.kv_heads.split(",")):
            for batch in batches:
                q, k, v, tables, ctx = random_paged_batch(batch, kvh, width, (lo, hi), gen, BLOCK, HEAD_DIM,
                                                          args.group)
                rule = choose_num_splits(batch, kvh, width, num_sms=sms)
                row = {"batch": batch, "kv_heads": kvh, "width": width, "ctx": [lo, hi], "rule": rule}
                scales, extra = None, ""
                if args.kv_fp8:
                    row["bf16_rule_us"] = decode_us(q, k, v, tables, ctx, rule)
                    # N(0, 1) values are well inside e4m3's range: a plain cast quantizes them at scale 1.
                    k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
                    scales = (torch.ones(1, device="cuda"),) * 2
                times = {s: decode_us(q, k, v, tables, ctx, s, scales, args.tile) for s in SPLITS if s <= width}
                best = min(times, key=times.get)
                rule_us = times.get(rule) or decode_us(q, k, v, tables, ctx, rule, scales, args.tile)
                if args.kv_fp8:
                    extra = f"{row['bf16_rule_us']:>9.1f}{rule_us / row['bf16_rule_us']:>9.2f}"
                print(f"{batch:>4}{kvh:>4}{f'{lo}-{hi}':>12}{best:>6}{times[best]:>8.1f}{rule:>6}{rule_us:>8.1f}"
                      f"{rule_us / times[best] - 1:>7.1%}{extra}")
                rows.append({**row, "rule_us": rule_us, "us": {str(s): t for s, t in times.items()}})
                del k, v
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
