"""Launch configurations of the paged-decode kernel on an FP8 cache, against bf16 (H200).

    PYTHONPATH=. python3 benchmarks/kernels/bench_decode_fp8_config.py

Shapes of the bench workload's decode steps (contexts 200-2,000 tokens, batch 32-256) for
Qwen3-0.6B (8 kv heads, 2 query heads each) and Qwen3-8B (8 kv heads, 4 each); for each, the
bf16 kernel at its rule, and the FP8 kernel with (tile, warps, stages) and split multipliers:
us per call from a CUDA graph, and the achieved KV bandwidth (bytes of the contexts read).
"""

from __future__ import annotations

import argparse
import itertools

import torch

import nanovllm.kernels.paged_decode as paged_decode
from nanovllm.kernels.paged_decode import choose_num_splits, paged_decode_attention
from timing import cuda_graph_us, random_paged_batch  # benchmarks/kernels/timing.py (this folder)

CONFIGS = [(64, 2, 3), (64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2), (32, 4, 3)]  # the first: the default
SPLIT_FACTORS = (1,)


def run(q, k, v, tables, ctx, splits, scales, config) -> float:
    kw = {"k_scale": scales[0], "v_scale": scales[1]} if scales else {}
    default = paged_decode._launch_config
    if config:
        paged_decode._launch_config = lambda head_dim, elem_size, fp8=False: config
    try:
        return cuda_graph_us(lambda: paged_decode_attention(q, k, v, tables, ctx, 128 ** -0.5, splits, **kw))
    finally:
        paged_decode._launch_config = default


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=CONFIGS, help="tile/warps/stages,... (default: %s)"
                    % ",".join("/".join(map(str, c)) for c in CONFIGS),
                    type=lambda v: [tuple(int(x) for x in c.split("/")) for c in v.split(",")])
    ap.add_argument("--split-factors", default=SPLIT_FACTORS, help="multipliers of the split rule, e.g. 1,2 (default 1)",
                    type=lambda v: tuple(int(x) for x in v.split(",")))
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    one = torch.ones(1, device="cuda")
    print(f"{'model':<6}{'B':>5}{'ctx':>11}{'bf16 us':>9}{'TB/s':>6}  " + "  ".join(
        f"{t}/{w}/{s}x{f}" for (t, w, s), f in itertools.product(args.configs, args.split_factors)))
    for group, batch, lo, hi in ((2, 256, 500, 1100), (2, 64, 1000, 2000), (4, 256, 500, 1100), (4, 32, 200, 1000)):
        q, k, v, tables, ctx = random_paged_batch(batch, 8, 8, (lo, hi), gen, group=group)
        k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        rule = choose_num_splits(batch, 8, tables.shape[1], num_sms=sms)
        tokens = ctx.sum().item()
        bf16 = run(q, k, v, tables, ctx, rule, None, None)
        cells = []
        for config, factor in itertools.product(args.configs, args.split_factors):
            us = run(q, k8, v8, tables, ctx, min(rule * factor, 64), (one, one), config)
            cells.append(f"{us:7.1f} ({tokens * 8 * 128 * 2 / us / 1e6:3.1f})")
        name = "0.6b" if group == 2 else "8b"
        print(f"{name:<6}{batch:>5}{f'{lo}-{hi}':>11}{bf16:>9.1f}{tokens * 8 * 128 * 4 / bf16 / 1e6:>6.2f}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
