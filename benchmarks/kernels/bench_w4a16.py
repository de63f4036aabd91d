"""The W4A16 GEMM (kernels/w4a16.py) against bf16 F.linear on Qwen3-8B's decoder GEMMs, timed from
CUDA graphs (benchmarks/kernels/timing.py), with the bandwidth it reaches.

    PYTHONPATH=. python3 benchmarks/kernels/bench_w4a16.py [--m 1,16,64,256] [--sweep]

Per GEMM (K x N) and M: microseconds of bf16 and of INT4 (group 128), the bytes the INT4 GEMM must
move (0.5 byte per weight, a bf16 scale and zero point per group and column, x and out) over its
time = achieved GB/s, and the fraction of 4.3 TB/s. Each output is first checked against its fp32
arithmetic (dequantized weight, TF32 off): max |out - ref| / max |ref| above 1e-2 is WRONG. With
--sweep, a few launches per shape (kernels/w4a16.py's Gemv, Mma or Dequant) and the best one;
with --mma, the tensor-core launches named instead of choose's.
At M = 1, gate_up also with SiLU * up: the GEMV then fused_ops.silu_and_mul against
the GEMV writing it from its epilogue. Writes $OUT/w4a16.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import triton
import torch.nn.functional as F

from timing import cuda_graph_us  # benchmarks/kernels/timing.py (this folder)
from nanovllm.features.quantization.int4_formats import Int4Weights, dequantize
from nanovllm.kernels.fused_ops import silu_and_mul
from nanovllm.kernels.w4a16 import GEMV_MAX_M, Dequant, Gemv, Mma, Strips, choose, w4a16_matmul
from nanovllm.kernels.w4a16_gemv import gemv

GEMMS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)}
BANDWIDTH = 4.3e12


def weights(k: int, n: int, group: int, gen) -> Int4Weights:
    q = torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=gen, device="cuda", dtype=torch.int64).to(torch.int32)
    s = (torch.rand(k // group, n, generator=gen, device="cuda") * 0.004).to(torch.bfloat16)
    z = torch.randint(0, 16, (k // group, n), generator=gen, device="cuda").to(torch.bfloat16)
    return Int4Weights(q, s, z, group, None)


def candidates(m: int) -> list:
    if m == 1:
        return [Strips(bn, wp) for bn in (16, 32) for wp in (4, 8)] + [
            Gemv(bn, bw, 8, 4, True, True) for bn, bw in ((8, 256), (16, 128), (32, 64))]
    gemv = [Gemv(bn, bw, wp, 4, False, False) for bn, bw in ((8, 256), (16, 128), (32, 64)) for wp in (4, 8)]
    if m <= 64:
        bms = sorted({max(16, triton.next_power_of_2(m)), max(16, triton.next_power_of_2(m) // 2)})
        return (gemv if m <= GEMV_MAX_M else []) + [
            Mma(bm, bn, 128, sp, bn // 16) for bm in bms for bn in (64, 128) for sp in (1, 2, 4)]
    # bn // 16 warps: one warpgroup per 64 weight columns (fewer spill the tile to shared memory);
    # K split 2-4 ways where the tiles alone leave SMs with one program or none (o, down: N = 4096)
    if os.environ.get("SWEEP_SPLITS"):
        return [Mma(bm, bn, 64, sp, bn // 16, 4) for bm in (64, 128) for bn in (64, 128) for sp in (1, 2, 3, 4)]
    return [Dequant()] + [Mma(bm, bn, bk, 1, bn // 16, st) for bm in (64, 128, 256) for bn in (64, 128, 256)
                          for bk in (64, 128) for st in (3, 4) if bm * bn <= 256 * 128]


def rotating(make, nbytes: int):
    """`make()` copies enough to exceed L2 (50 MB) several times over, taken in turn by each call
    (an engine's step reads every layer's weights once, so nothing stays in L2 between reads)."""
    copies = [make() for _ in range(max(1, min(16, -(-200_000_000 // nbytes))))]
    it = itertools.cycle(copies)
    return copies[0], lambda: next(it)


def row(name: str, k: int, n: int, m: int, sweep: bool, gen, launch=None) -> dict:
    w, next_w = rotating(lambda: weights(k, n, 128, gen), k * n // 2)
    x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    dense, next_dense = rotating(lambda: dequantize(w).to(torch.bfloat16).t().contiguous(), k * n * 2)
    ref = x.float() @ dequantize(w)
    out = w4a16_matmul(x, w.qweight, w.scales, w.zeros, 128, config=launch)
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    us_bf16 = cuda_graph_us(lambda: F.linear(x, next_dense()), median=True)
    mm = lambda cfg=None: (lambda v: w4a16_matmul(x, v.qweight, v.scales, v.zeros, 128, config=cfg))(next_w())  # noqa: E731
    us = cuda_graph_us(lambda: mm(launch), median=True)
    moved = k * n / 2 + 2 * (k // 128) * n * 2 + 2 * m * (k + n)
    result = {"gemm": name, "k": k, "n": n, "m": m, "bf16_us": round(us_bf16, 2), "int4_us": round(us, 2),
              "speedup": round(us_bf16 / us, 2), "gb_s": round(moved / us / 1e3, 1),
              "of_bandwidth": round(moved / us / 1e-6 / BANDWIDTH, 3), "rel_err": err, "ok": err < 1e-2}
    if launch is not None:
        result["launch"] = tuple(launch)
    if name == "gate_up" and m == 1:  # SiLU * up: its own kernel after the GEMV, or the GEMV's epilogue
        cfg = choose(1, n, k)
        result["silu_unfused_us"] = round(cuda_graph_us(lambda: silu_and_mul(mm(cfg)), median=True), 2)
        result["silu_fused_us"] = round(cuda_graph_us(
            lambda: (lambda v: gemv(x, v.qweight, v.scales, v.zeros, 128, cfg, silu_mul=True))(next_w()), median=True), 2)
    if sweep:
        timed = []
        for cfg in candidates(m):
            try:
                got = w4a16_matmul(x, w.qweight, w.scales, w.zeros, 128, config=cfg)
                if ((got.float() - ref).abs().max() / ref.abs().max()).item() > 1e-2:
                    result.setdefault("wrong", []).append(tuple(cfg))
                    continue
                timed.append((cuda_graph_us(lambda: mm(cfg), median=True), cfg))
            except triton.runtime.errors.OutOfResources:  # (a tile too large for shared memory)
                continue
        best = min(timed)
        result["timed"] = {str(tuple(c)): round(t, 2) for t, c in timed}
        result["best_us"], result["best_config"] = round(best[0], 2), tuple(best[1])
        kind = lambda c: type(c).__name__ + ("" if getattr(c, "prefetch", True) else "-noprefetch") + (  # noqa: E731
            "" if getattr(c, "factored", True) else "-128q")
        result["best_per_kind"] = {kind(c): round(min(t for t, c2 in timed if kind(c2) == kind(c)), 2) for _, c in timed}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1,2,16,64,128,256,512")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--mma", help="Mma launches instead of choose's, ';' between them: 128,64,64,1,4,4;256,64,64,1,4,4")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    launches = [Mma(*map(int, t.split(","))) for t in args.mma.split(";")] if args.mma else [None]
    rows = [row(name, k, n, int(m), args.sweep, gen, launch) for launch in launches for m in args.m.split(",")
            for name, (k, n) in GEMMS.items()]
    print(f"{'gemm':<8}{'M':>5}{'bf16 us':>9}{'int4 us':>9}{'x':>6}{'GB/s':>8}{'of BW':>7}  check")
    for r in rows:
        extra = f"  best {r['best_us']} {r['best_config']} {r['best_per_kind']}" if "best_us" in r else ""
        extra += f" WRONG configs {r['wrong']}" if r.get("wrong") else ""
        extra += f"  {r['launch']}" if "launch" in r else ""
        extra += f"  silu unfused {r['silu_unfused_us']} fused {r['silu_fused_us']}" if "silu_fused_us" in r else ""
        print(f"{r['gemm']:<8}{r['m']:>5}{r['bf16_us']:>9}{r['int4_us']:>9}{r['speedup']:>6}{r['gb_s']:>8}"
              f"{r['of_bandwidth']:>7}  {'ok' if r['ok'] else 'WRONG'}{extra}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "w4a16.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
