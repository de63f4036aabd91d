"""Large-M W4A16 (64-256 rows): is dequantizing the weight in column chunks small enough to stay
in L2, each chunk multiplied by cuBLAS right after, cheaper than the whole weight at once?

The engine's Dequant path (kernels/w4a16.py) writes the whole 16-bit weight to a workspace and
cuBLAS reads it back: 0.5 + 2 + 2 bytes a weight through HBM against bf16's 2 (2.25x), so INT4
runs at 0.5-0.64x of bf16 from 128 rows. If a chunk of the workspace (a few MB) stays in L2
between its write and cuBLAS's read, and is overwritten there by the next chunk before it is
evicted, HBM sees ~0.5 byte a weight, and the product becomes compute-bound like bf16's.

    PYTHONPATH=.:benchmarks/kernels python3 benchmarks/kernels/bench_w4a16_chunks.py [--m 32,64,128,256]

Per GEMM and M: microseconds of bf16 F.linear, of the engine's launch (`choose`), of whole-weight
dequant + cuBLAS, and of kernels/w4a16.py's Dequant in chunks of --chunk-mb 16-bit megabytes
(each into its output columns, a strided view); each checked against fp32 arithmetic first.
If chunks win, set DEQUANT_CHUNK_BYTES and A/B the engine. $OUT/w4a16_chunks.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from bench_w4a16 import GEMMS, rotating, weights
from timing import cuda_graph_us
from nanovllm.features.quantization.int4_formats import dequantize
from nanovllm.kernels.w4a16 import Dequant, dequant_chunk, w4a16_matmul


def row(name: str, k: int, n: int, m: int, chunk_mb: list[int], gen) -> dict:
    w, next_w = rotating(lambda: weights(k, n, 128, gen), k * n // 2)
    x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    _, next_dense = rotating(lambda: dequantize(w).to(torch.bfloat16).t().contiguous(), k * n * 2)
    ref = x.float() @ dequantize(w)
    ws = torch.empty(k * n, dtype=torch.bfloat16, device="cuda")
    err = lambda got: ((got.float() - ref).abs().max() / ref.abs().max()).item()  # noqa: E731
    mm = lambda v, cfg=None: w4a16_matmul(x, v.qweight, v.scales, v.zeros, 128, config=cfg, workspace=ws)  # noqa: E731
    res = {"gemm": name, "k": k, "n": n, "m": m, "errors": {}}
    res["bf16_us"] = cuda_graph_us(lambda: F.linear(x, next_dense()), median=True)
    res["engine_us"] = cuda_graph_us(lambda: mm(next_w()), median=True)
    for mb in [0] + chunk_mb:
        cfg = Dequant(chunk=dequant_chunk(k, mb << 20))
        if cfg.chunk >= n:
            continue
        res["errors"][mb] = err(mm(w, cfg))
        res[f"{mb}MB_us" if mb else "whole_us"] = cuda_graph_us(lambda: mm(next_w(), cfg), median=True)
    return {key: round(v, 2) if isinstance(v, float) else v for key, v in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="32,64,128,256")
    ap.add_argument("--chunk-mb", default="2,4,8,16,32", help="16-bit MB of a chunk (Dequant's chunk)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    chunk_mb = [int(c) for c in args.chunk_mb.split(",")]
    rows = [row(name, k, n, int(m), chunk_mb, gen) for m in args.m.split(",") for name, (k, n) in GEMMS.items()]
    for r in rows:
        bad = {c: e for c, e in r["errors"].items() if e > 1e-2}
        timings = "  ".join(f"{key[:-3]} {v}" for key, v in r.items() if key.endswith("_us"))
        print(f"{r['gemm']:<8} M={r['m']:<4} {timings}{'  WRONG ' + str(bad) if bad else ''}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "w4a16_chunks.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
