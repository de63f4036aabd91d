"""Large-M W4A16 (64-256 rows): is dequantizing the weight in column chunks small enough to stay
in L2, each chunk multiplied by cuBLAS right after, cheaper than the whole weight at once?

The engine's Dequant path (kernels/w4a16.py) writes the whole 16-bit weight to a workspace and
cuBLAS reads it back: 0.5 + 2 + 2 bytes a weight through HBM against bf16's 2 (2.25x), so INT4
runs at 0.5-0.64x of bf16 from 128 rows. If a chunk of the workspace (a few MB) stays in L2
between its write and cuBLAS's read, and is overwritten there by the next chunk before it is
evicted, HBM sees ~0.5 byte a weight, and the product becomes compute-bound like bf16's.

    PYTHONPATH=.:benchmarks/kernels python3 benchmarks/kernels/bench_w4a16_chunks.py [--m 32,64,128,256]

Per GEMM and M: microseconds of bf16 F.linear, of the engine's launch (`choose`), of whole-weight
dequant + cuBLAS, and of chunked dequant + cuBLAS per chunk width (output written in place, a
strided view); each result checked against fp32 arithmetic first. $OUT/w4a16_chunks.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench_w4a16 import GEMMS, rotating, weights
from timing import cuda_graph_us
from nanovllm.features.quantization.int4_formats import dequantize
from nanovllm.kernels.w4a16 import Dequant, w4a16_matmul
from nanovllm.kernels.w4a16_mma import float_128


@triton.jit
def _dequant_cols(qw_ptr, s_ptr, z_ptr, out_ptr, N, C, K, GROUP: tl.constexpr, BLOCK_W: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Columns [0, C) of a [K, N] weight (pointers already at the chunk's first column) into out [K, C]."""
    w3 = (tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W))[:, None, None]
    j3 = tl.arange(0, 8)[None, :, None]
    n3 = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N))[None, None, :]
    mask = (w3 < K // 8) & (n3 < C)
    words = tl.load(qw_ptr + w3 * N + n3, mask=mask, other=0)
    sz = (w3 * 8 // GROUP) * N + n3
    s = tl.load(s_ptr + sz, mask=mask, other=0.0).to(tl.float32)
    c = (tl.load(z_ptr + sz, mask=mask, other=0.0).to(tl.float32) + 128.0) * s
    q = float_128(((words >> (4 * j3)) & 0xF) << 16)
    tl.store(out_ptr + (w3 * 8 + j3) * C + n3, tl.fma(q, s, -c).to(out_ptr.dtype.element_ty), mask=mask & (j3 < 8))


def chunked(x, w, out, ws, chunk: int, block_w: int = 8, block_n: int = 128):
    """out = x @ dequantize(w), `chunk` columns at a time through the workspace ws."""
    k, n = w.qweight.shape[0] * 8, w.qweight.shape[1]
    for n0 in range(0, n, chunk):
        c = min(chunk, n - n0)
        part = ws[: k * c].view(k, c)
        _dequant_cols[(triton.cdiv(k // 8, block_w), triton.cdiv(c, block_n))](
            w.qweight[:, n0:], w.scales[:, n0:], w.zeros[:, n0:], part, n, c, k, GROUP=w.group_size,
            BLOCK_W=block_w, BLOCK_N=block_n)
        torch.mm(x, part, out=out[:, n0:n0 + c])
    return out


def row(name: str, k: int, n: int, m: int, chunks: list[int], gen) -> dict:
    w, next_w = rotating(lambda: weights(k, n, 128, gen), k * n // 2)
    x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    dense, next_dense = rotating(lambda: dequantize(w).to(torch.bfloat16).t().contiguous(), k * n * 2)
    ref = x.float() @ dequantize(w)
    ws = torch.empty(k * n, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    err = lambda got: ((got.float() - ref).abs().max() / ref.abs().max()).item()  # noqa: E731
    res = {"gemm": name, "k": k, "n": n, "m": m, "errors": {}}
    res["bf16_us"] = cuda_graph_us(lambda: F.linear(x, next_dense()), median=True)
    res["engine_us"] = cuda_graph_us(lambda: (lambda v: w4a16_matmul(x, v.qweight, v.scales, v.zeros, 128))(next_w()),
                                     median=True)
    whole = lambda: (lambda v: w4a16_matmul(x, v.qweight, v.scales, v.zeros, 128, config=Dequant(),  # noqa: E731
                                            workspace=ws))(next_w())
    res["errors"]["whole"] = err(whole())
    res["whole_us"] = cuda_graph_us(whole, median=True)
    for c in chunks:
        if c >= n:
            continue
        res["errors"][c] = err(chunked(x, w, out, ws, c))
        res[f"chunk{c}_us"] = cuda_graph_us(lambda: chunked(x, next_w(), out, ws, c), median=True)
    return {key: round(v, 2) if isinstance(v, float) else v for key, v in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="32,64,128,256")
    ap.add_argument("--chunks", default="512,1024,2048,4096")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    chunks = [int(c) for c in args.chunks.split(",")]
    rows = [row(name, k, n, int(m), chunks, gen) for m in args.m.split(",") for name, (k, n) in GEMMS.items()]
    for r in rows:
        bad = {c: e for c, e in r["errors"].items() if e > 1e-2}
        timings = "  ".join(f"{key[:-3]} {v}" for key, v in r.items() if key.endswith("_us"))
        print(f"{r['gemm']:<8} M={r['m']:<4} {timings}{'  WRONG ' + str(bad) if bad else ''}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "w4a16_chunks.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
