"""The batch-1 dense GEMV (kernels/dense_gemv.py) against what the engine runs without it, on
Qwen3-0.6B's and Qwen3-8B's decoder GEMMs at M = 1, timed from CUDA graphs with the weights
cold in L2 (benchmarks/kernels/timing.py).

    PYTHONPATH=. python3 benchmarks/kernels/bench_dense_gemv.py [--sweep]

Per GEMM, microseconds of:
- bf16: cuBLAS (F.linear) | the GEMV; folds: RMSNorm (+ residual) then cuBLAS | the GEMV with
  the norm as its prologue (qkv, gate_up); the GEMV then SiLU * up | the GEMV writing SiLU * up
  from its epilogue (gate_up);
- FP8 (one scale per tensor): the engine's path (activation amax + cast, torch._scaled_mm) | the
  GEMV (weights converted in registers, no activation quantization) | the same folds;
- chains o -> norm -> gate_up and down -> norm -> qkv: 3 kernels (GEMV, residual add + RMSNorm,
  GEMV) against 2 (the first GEMV adding the residual and writing the stream times the norm weight
  and its sums of squares, the second scaling by the rsqrt made from them: Prologue.NORM_PARTS).
Each GEMV output is first checked against fp32 arithmetic (max |out - ref| / max |ref| > 1e-2:
WRONG). --sweep times a few tiles per GEMM and keeps the best. Writes $OUT/dense_gemv.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from timing import cuda_graph_us  # benchmarks/kernels/timing.py (this folder)
from nanovllm.features.quantization.fp8_ops import fp8_tensor_linear, quantize_weight_per_tensor_fp8
from nanovllm.kernels.dense_gemv import Prologue, Tile, choose, dense_gemv
from nanovllm.kernels.fused_ops import rms_norm, silu_and_mul

# (N, K) of nn.Linear's weight; what may fold into its GEMV in a decoder layer.
GEMMS = {
    "0.6b": {"qkv": (4096, 1024, ("norm",)), "o": (1024, 2048, ()), "gate_up": (6144, 1024, ("norm", "silu")),
             "down": (1024, 3072, ())},
    "8b": {"qkv": (6144, 4096, ("norm",)), "o": (4096, 4096, ()), "gate_up": (24576, 4096, ("norm", "silu")),
           "down": (4096, 12288, ())},
}
BANDWIDTH = 4.3e12


def rotating(make, nbytes: int):
    """Enough copies to exceed L2 (50 MB) several times, taken in turn by each call."""
    copies = [make() for _ in range(max(1, min(16, -(-200_000_000 // nbytes))))]
    state = {"i": 0}

    def next_copy():
        state["i"] = (state["i"] + 1) % len(copies)
        return copies[state["i"]]
    return copies[0], next_copy


def tiles(k: int, fp8: bool) -> list[Tile]:
    per = 16 if fp8 else 8
    return [Tile(bn, bk, wp) for bn in (4, 8, 16) for bk in (64 * per, 128 * per, 256 * per) for wp in (4, 8)
            if bk <= max(k, 64 * per) and bk // per <= 32 * wp * 4]


def check(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def _folds(res: dict, folds, x, r, nw, next16, next8, scale) -> None:
    """Times of each fold: unfused (the kernel, then the product) and fused into the GEMV."""
    f8 = {"scale": scale}
    if "norm" in folds:
        before = lambda: rms_norm(x, nw, 1e-6, r)[0]  # noqa: E731
        fused = dict(prologue=Prologue.RMS_NORM, residual=r, norm_weight=nw)
        res["bf16_norm_unfused_us"] = cuda_graph_us(lambda: F.linear(before(), next16()), median=True)
        res["bf16_norm_fused_us"] = cuda_graph_us(lambda: dense_gemv(x, next16(), **fused), median=True)
        res["fp8_norm_unfused_us"] = cuda_graph_us(lambda: fp8_tensor_linear(before(), next8(), scale, None), median=True)
        res["fp8_norm_fused_us"] = cuda_graph_us(lambda: dense_gemv(x, next8(), **f8, **fused), median=True)
    if "silu" in folds:
        res["bf16_silu_unfused_us"] = cuda_graph_us(lambda: silu_and_mul(dense_gemv(x, next16())), median=True)
        res["bf16_silu_fused_us"] = cuda_graph_us(lambda: dense_gemv(x, next16(), silu_mul=True), median=True)
        res["fp8_silu_unfused_us"] = cuda_graph_us(lambda: silu_and_mul(dense_gemv(x, next8(), **f8)), median=True)
        res["fp8_silu_fused_us"] = cuda_graph_us(lambda: dense_gemv(x, next8(), **f8, silu_mul=True), median=True)


def row(model: str, name: str, n: int, k: int, folds: tuple, sweep: bool, gen) -> dict:
    dev = "cuda"
    w16, next16 = rotating(lambda: (torch.randn(n, k, generator=gen, device=dev) * 0.02).to(torch.bfloat16), n * k * 2)
    q8 = [quantize_weight_per_tensor_fp8(w16.clone())]
    w8, next8 = rotating(lambda: quantize_weight_per_tensor_fp8(next16())[0], n * k)
    scale = q8[0][1].reshape(1).float()
    x = torch.randn(1, k, generator=gen, device=dev).to(torch.bfloat16)
    r = torch.randn(1, k, generator=gen, device=dev).to(torch.bfloat16)
    nw = (torch.rand(k, generator=gen, device=dev) + 0.5).to(torch.bfloat16)
    res = {"model": model, "gemm": name, "n": n, "k": k, "folds": list(folds)}
    errs = [check(dense_gemv(x, w16), x.float() @ w16.float().t()),
            check(dense_gemv(x, q8[0][0], scale=scale), x.float() @ (q8[0][0].float() * scale).t())]
    res["rel_err"] = max(errs)
    res["bf16_cublas_us"] = cuda_graph_us(lambda: F.linear(x, next16()), median=True)
    res["bf16_gemv_us"] = cuda_graph_us(lambda: dense_gemv(x, next16()), median=True)
    res["fp8_engine_us"] = cuda_graph_us(lambda: fp8_tensor_linear(x, next8(), scale, None), median=True)
    res["fp8_gemv_us"] = cuda_graph_us(lambda: dense_gemv(x, next8(), scale=scale), median=True)
    _folds(res, folds, x, r, nw, next16, next8, scale)
    if sweep:
        for fp8, nxt, key in ((False, next16, "bf16"), (True, next8, "fp8")):
            kw = {"scale": scale} if fp8 else {}
            timed = sorted((cuda_graph_us(lambda t=t: dense_gemv(x, nxt(), tile=t, **kw), median=True), t)
                           for t in tiles(k, fp8))
            res[f"{key}_best"] = [round(timed[0][0], 2), tuple(timed[0][1])]
            res[f"{key}_default"] = tuple(choose(n, k, torch.float8_e4m3fn if fp8 else torch.bfloat16))
            res[f"{key}_timed"] = {str(tuple(t)): round(us, 2) for us, t in timed}
    for key in [k2 for k2 in res if k2.endswith("_us")]:
        res[key] = round(res[key], 2)
    res["bf16_gemv_of_bw"] = round(n * k * 2 / (res["bf16_gemv_us"] * 1e-6) / BANDWIDTH, 3)
    res["fp8_gemv_of_bw"] = round(n * k / (res["fp8_gemv_us"] * 1e-6) / BANDWIDTH, 3)
    return res


def chain(model: str, producer: str, consumer: str, gen) -> dict:
    """The producer's GEMV, the residual add + RMSNorm, the consumer's GEMV (3 kernels) against the
    producer adding the residual and writing the stream times the norm weight and its sums of squares, the
    consumer scaling by the rsqrt made from those (NORM_PARTS, 2 kernels): microseconds of each chain, bf16 and FP8 (per-tensor) weights."""
    (n1, k1, _), (n2, k2, _) = GEMMS[model][producer], GEMMS[model][consumer]
    dev, res = "cuda", {"model": model, "chain": f"{producer} -> norm -> {consumer}"}
    x = torch.randn(1, k1, generator=gen, device=dev).to(torch.bfloat16)
    r = torch.randn(1, n1, generator=gen, device=dev).to(torch.bfloat16)
    nw = (torch.rand(k2, generator=gen, device=dev) + 0.5).to(torch.bfloat16)
    for kind in ("bf16", "fp8"):
        make = lambda n, k: (torch.randn(n, k, generator=gen, device=dev) * 0.02).to(torch.bfloat16)  # noqa: E731
        if kind == "fp8":
            make = lambda n, k, m=make: quantize_weight_per_tensor_fp8(m(n, k))[0]  # noqa: E731
        _, p_next = rotating(lambda: make(n1, k1), n1 * k1 * 2)
        _, c_next = rotating(lambda: make(n2, k2), n2 * k2 * 2)
        f8 = {"scale": torch.ones(1, device=dev)} if kind == "fp8" else {}

        gated = {"silu_mul": consumer == "gate_up"}  # as the engine runs gate_up: SiLU * up from its epilogue

        def unfused():
            h, _ = rms_norm(dense_gemv(x, p_next(), **f8), nw, 1e-6, r)
            return dense_gemv(h, c_next(), **f8, **gated)

        def fused():
            s, parts, scaled = dense_gemv(x, p_next(), add_residual=r, next_norm_weight=nw, **f8)
            return dense_gemv(scaled, c_next(), prologue=Prologue.NORM_PARTS, norm_parts=parts, **f8,
                              **gated)
        res[f"{kind}_unfused_us"] = round(cuda_graph_us(unfused, median=True), 2)
        res[f"{kind}_fused_us"] = round(cuda_graph_us(fused, median=True), 2)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = [row(model, name, n, k, p, args.sweep, gen) for model, gemms in GEMMS.items()
            for name, (n, k, p) in gemms.items()]
    cols = ["bf16_cublas_us", "bf16_gemv_us", "fp8_engine_us", "fp8_gemv_us"] + [
        f"{t}_{f}_{u}_us" for f in ("norm", "silu") for t in ("bf16", "fp8") for u in ("unfused", "fused")] + [
        "bf16_gemv_of_bw", "fp8_gemv_of_bw"]
    print(f"{'gemm':<12}" + "".join(f"{c.replace('_us', ''):>16}" for c in cols) + "  check  best")
    for r in rows:
        best = f"  bf16 {r.get('bf16_best')} fp8 {r.get('fp8_best')}" if "bf16_best" in r else ""
        print(f"{r['model'] + ' ' + r['gemm']:<12}" + "".join(f"{r.get(c, '-'):>16}" for c in cols)
              + f"  {'ok' if r['rel_err'] < 1e-2 else 'WRONG'}{best}")
    chains = [chain(model, p, c, gen) for model in GEMMS for p, c in (("o", "gate_up"), ("down", "qkv"))]
    for c in chains:
        print(f"{c['model']} {c['chain']:<22} bf16 {c['bf16_unfused_us']} -> {c['bf16_fused_us']} us, "
              f"fp8 {c['fp8_unfused_us']} -> {c['fp8_fused_us']} us")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "dense_gemv.json"), "w") as f:
            json.dump({"gemms": rows, "norm_chains": chains}, f, indent=1)


if __name__ == "__main__":
    main()
