"""Fused MoE kernel (nanovllm/kernels/fused_moe.py) at Qwen3-30B-A3B's shapes, bf16 and block-FP8.

    python3 benchmarks/kernels/bench_fused_moe.py [--tokens 1 8 ...] [--sweep] [--json PATH]

H = 2048, I = 768, E = 128, k = 8 (one rank, no TP), T tokens with random routing (route_topk
on random logits). For each T and each variant (bf16 experts, FP8 experts with 128x128 block
scales and per-token-group activation quantization) it
- checks the output against a plain-torch fp32 reference (loop over experts; the FP8 variant
  against the unquantized bf16 weights) and prints the normwise relative error;
- times fused_moe and its three steps (alignment, gate_up, down) from CUDA graphs of 20 calls
  (benchmarks/kernels/timing.py);
- reports the achieved bandwidth over the bytes that must move: the weights of the experts the
  routing actually hits (distinct experts, with their FP8 scales) plus every activation tensor
  written once and read once, and TFLOP/s (2 * T * k * 3 * H * I flops).
With --sweep it also times a few alternative tile configs per T and prints the best (to tune
fused_moe.get_config); that adds about a minute of compiles. Writes $OUT/fused_moe.json when
$OUT is set (or --json). Takes about a minute on an H200 without --sweep.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from nanovllm.kernels import fused_moe as fm  # noqa: E402
from nanovllm.features.moe import route_topk  # noqa: E402
from nanovllm.features.quantization.fp8_ops import quantize_weight_block_fp8  # noqa: E402
from timing import cuda_graph_us  # noqa: E402  (benchmarks/kernels/timing.py, beside this script)

H, I, E, K = 2048, 768, 128, 8
TOKENS = (1, 8, 32, 64, 128, 256, 512, 2048, 8192)
SWEEP = [  # (block_m, gate_up (bn, bk, warps, stages), down (bn, bk, warps, stages)); bk 128 for FP8
    (16, (32, 128, 4, 4), (64, 128, 4, 4)),
    (16, (64, 128, 4, 4), (128, 128, 4, 4)),
    (16, (32, 128, 4, 3), (32, 128, 4, 4)),
    (32, (64, 64, 4, 4), (64, 64, 4, 4)),
    (32, (64, 128, 4, 3), (128, 128, 4, 3)),
    (64, (64, 64, 4, 4), (128, 64, 4, 4)),
    (64, (128, 64, 8, 3), (128, 64, 4, 4)),
    (128, (64, 64, 8, 3), (128, 64, 8, 3)),
    (128, (128, 64, 8, 3), (256, 64, 8, 3)),
]


def reference(x, w13, w2, weights, ids):
    """fp32 loop over experts (bf16 weights upcast)."""
    out = torch.zeros(x.shape[0], H, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        tok, j = (ids == e).nonzero(as_tuple=True)
        gate_up = x[tok].float() @ w13[e].float().T
        h = torch.nn.functional.silu(gate_up[:, :I]) * gate_up[:, I:]
        out.index_add_(0, tok, (h @ w2[e].float().T) * weights[tok, j, None])
    return out


def moved_bytes(num_tokens: int, distinct: int, fp8: bool) -> int:
    """Weights of the routed experts (+ scales) and each activation tensor written once and read once."""
    wbytes = 1 if fp8 else 2
    weights = distinct * 3 * H * I * wbytes
    if fp8:
        weights += distinct * (2 * I // 128 * H // 128 + H // 128 * I // 128) * 4
    slots = num_tokens * K
    act = num_tokens * H * 2  # hidden read
    act += 2 * slots * I * 2  # intermediate written, read
    act += 2 * slots * H * 2  # slot outputs written, read by the sum
    act += num_tokens * H * 2  # output written
    if fp8:  # quantized copies of hidden and the intermediate (+ scales), written and read
        act += 2 * (num_tokens * H + slots * I) + 2 * 4 * (num_tokens * H + slots * I) // 128
    return weights + act


def config_from(row, fp8: bool) -> fm.MoEConfig:
    bm, gu, dn = row
    fix = (lambda c: (c[0], 128, c[2], c[3])) if fp8 else (lambda c: c)
    return fm.MoEConfig(bm, fm.GemmConfig(*fix(gu)), fm.GemmConfig(*fix(dn)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--sweep", action="store_true", help="also time the SWEEP tile configs per T")
    ap.add_argument("--json", default=os.path.join(os.environ["OUT"], "fused_moe.json") if os.environ.get("OUT") else None)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    w13 = (torch.randn(E, 2 * I, H, device=dev) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device=dev) / I**0.5).bfloat16()
    q13, s13 = quantize_weight_block_fp8(w13)  # (the engine's FP8 experts' format, fp32 scales)
    q2, s2 = quantize_weight_block_fp8(w2)
    variants = {"bf16": (w13, w2, {}), "fp8": (q13, q2, {"w13_scale": s13, "w2_scale": s2})}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'T':>5} {'var':>4} {'experts':>7} {'us':>8} {'align':>6} {'gate_up':>8} {'down':>7} {'GB/s':>7} "
          f"{'TFLOP/s':>8} {'rel err':>8}  config")
    rows = []
    for num_tokens in args.tokens:
        x = torch.randn(num_tokens, H, device=dev).bfloat16()
        weights, ids = route_topk(torch.randn(num_tokens, E, device=dev), K, True)
        distinct = ids.unique().numel()
        ref = reference(x, w13, w2, weights, ids)
        for name, (a, b, scales) in variants.items():
            fp8 = name == "fp8"
            cfg = fm.get_config(num_tokens, K, E, fp8)
            out = fm.fused_moe(x, a, b, weights, ids, **scales)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            # bf16: ~3 roundings to bf16 (2^-8) per term, normwise well below 1e-2; FP8: ~6.4%
            # expected (tests/test_fused_moe_kernel.py), 0.1 allowed.
            ok = err < (1e-2 if not fp8 else 0.1)
            us = cuda_graph_us(lambda: fm.fused_moe(x, a, b, weights, ids, **scales, config=cfg))
            sorted_ids, block_experts, _ = fm.align_tokens_to_experts(ids, E, cfg.block_m)
            inter = fm.moe_gate_up(x, a, sorted_ids, block_experts, K, cfg, scales.get("w13_scale"))
            us_align = cuda_graph_us(lambda: fm.align_tokens_to_experts(ids, E, cfg.block_m))
            us_gate_up = cuda_graph_us(lambda: fm.moe_gate_up(x, a, sorted_ids, block_experts, K, cfg,
                                                              scales.get("w13_scale")))
            us_down = cuda_graph_us(lambda: fm.moe_down(inter, b, weights, sorted_ids, block_experts, cfg,
                                                        scales.get("w2_scale")))
            nbytes = moved_bytes(num_tokens, distinct, fp8)
            gbs = nbytes / us / 1e3
            tflops = 2 * num_tokens * K * 3 * H * I / us / 1e6
            row = {"tokens": num_tokens, "variant": name, "distinct_experts": distinct, "us": us,
                   "align_us": us_align, "gate_up_us": us_gate_up, "down_us": us_down,
                   "bytes": nbytes, "GB_s": gbs, "TFLOP_s": tflops,
                   "rel_err": err, "correct": ok, "config": repr(cfg)}
            print(f"{num_tokens:>5} {name:>4} {distinct:>7} {us:>8.1f} {us_align:>6.1f} {us_gate_up:>8.1f} "
                  f"{us_down:>7.1f} {gbs:>7.0f} {tflops:>8.1f} {err:>8.2e}{'' if ok else ' WRONG'}  "
                  f"bm={cfg.block_m} {cfg.gate_up} {cfg.down}")
            if args.sweep:
                sweep = {}
                for cand in SWEEP:
                    c = config_from(cand, fp8)
                    try:
                        sweep[repr(c)] = cuda_graph_us(lambda: fm.fused_moe(x, a, b, weights, ids, **scales, config=c))
                    except Exception as exc:  # e.g. out of shared memory for a big tile
                        sweep[repr(c)] = f"failed: {type(exc).__name__}"
                timed = {k: v for k, v in sweep.items() if isinstance(v, float)}
                best = min(timed, key=timed.get)
                print(f"      sweep best {timed[best]:.1f} us ({us / timed[best] - 1:+.0%} for get_config): {best}")
                row["sweep_us"] = sweep
            rows.append(row)
            del inter
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"shape": {"hidden": H, "inter": I, "experts": E, "top_k": K}, "device": torch.cuda.get_device_name(),
                       "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    if not all(r["correct"] for r in rows):
        sys.exit("some results are WRONG (rel err column)")


if __name__ == "__main__":
    main()
