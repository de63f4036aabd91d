"""FP8 GEMMs against bf16 on the decoder GEMMs of Qwen3-8B and Qwen3-0.6B, timed from CUDA graphs.

    PYTHONPATH=. python3 benchmarks/kernels/bench_fp8_gemm.py [--no-sweep] [--models 8b,0.6b] [--m 1,64]

For every GEMM (K x N) and M: microseconds per GEMM (a CUDA graph of 20 calls, median of 10
replays) of
  bf16        F.linear
  tensor      torch._scaled_mm tensor-wise, the GEMM alone
  tensor+q    fp8_tensor_linear: Triton per-tensor activation quantization + that GEMM
  row         torch._scaled_mm row-wise, the GEMM alone
  cublas-blk  F.scaled_mm BlockWise1x128 x BlockWise128x128, the GEMM alone
  cublas-blk+q  the same after the Triton per-token-group quantizer (outer-dim-major scales)
  triton      fp8_block_matmul with the config BLOCK_MATMUL_CONFIGS picks by M
  triton+q    fp8_block_linear: Triton per-token-group quantizer + fp8_block_matmul
  best        the fastest fp8_block_matmul of a small tile sweep (off with --no-sweep), and its config
with the ratio to bf16 beside each. Before timing, every candidate's output is checked against
its own arithmetic in fp32 (dequantized operands, TF32 off): max |out - ref| / max |ref| above
1e-2 marks it WRONG ('!' in the table). A candidate that raises shows 'fails'.

Fills in SCALED_MM_BLOCKWISE_MIN_M (fp8_ops) and BLOCK_MATMUL_CONFIGS (fp8_gemm). Writes all
rows to $OUT/fp8_gemm.json when $OUT is set. Planned for < 3 minutes on an H200 (untimed yet).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton

from nanovllm.kernels.fp8_gemm import BLOCK_MATMUL_CONFIGS, fp8_block_matmul, quantize_fp8_per_token_group
from nanovllm.features.quantization.fp8_ops import (
    FP8_DTYPE,
    dequantize_per_token_group,
    dequantize_weight_block_fp8,
    fp8_block_linear,
    fp8_tensor_linear,
    quantize_per_tensor_torch,
    quantize_per_token_group_torch,
    quantize_weight_block_fp8,
    quantize_weight_per_tensor_fp8,
    scaled_mm_blockwise,
)
from timing import cuda_graph_us  # benchmarks/kernels/timing.py (this folder)

# (model, gemm, K, N)
SHAPES = [
    ("8b", "qkv", 4096, 6144), ("8b", "o", 4096, 4096), ("8b", "gate_up", 4096, 24576), ("8b", "down", 12288, 4096),
    ("0.6b", "qkv", 1024, 4096), ("0.6b", "o", 2048, 1024), ("0.6b", "gate_up", 1024, 6144), ("0.6b", "down", 3072, 1024),
]
BATCHES = (1, 8, 32, 64, 128, 256, 512, 1024, 8192)
CANDIDATES = ("bf16", "tensor", "tensor+q", "row", "cublas-blk", "cublas-blk+q", "triton", "triton+q")
# fp8_block_matmul tiles tried by the sweep: (BLOCK_M, BLOCK_N, GROUP_M, num_warps, num_stages)
SWEEP = [(16, 32, 1, 4, 4), (16, 64, 1, 4, 4), (16, 128, 1, 4, 3), (32, 64, 8, 4, 4), (64, 64, 8, 4, 4),
         (64, 128, 8, 4, 3), (128, 64, 8, 4, 3), (128, 128, 8, 8, 3), (128, 128, 8, 4, 4)]
WRONG = 1e-2
DEVICE = "cuda"


def graph_us(fn) -> float:
    """Median microseconds per call in a CUDA graph of 20 calls (timing.cuda_graph_us)."""
    return cuda_graph_us(fn, 20, 10, median=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 codes and fp32 scales [rows, 1] (setup for the row-wise candidate only)."""
    s = (t.float().abs().amax(1, keepdim=True) / 448.0).clamp_min(1e-12)
    return (t.float() / s).clamp(-448, 448).to(FP8_DTYPE), s


def once(fn):
    """fn(), computed on the first call only (the fp32 references are shared by candidates)."""
    memo = []
    return lambda: memo[0] if memo else memo.append(fn()) or memo[0]


class Weights:
    """One GEMM's weight in bf16 and in each FP8 format."""

    def __init__(self, k: int, n: int):
        self.w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) / k**0.5
        self.t_q, self.t_s = quantize_weight_per_tensor_fp8(self.w)
        self.r_q, r_s = rowwise(self.w)
        self.r_s = r_s.t().contiguous()  # [1, N]
        self.b_q, self.b_s = quantize_weight_block_fp8(self.w)


def candidates(x: torch.Tensor, wt: Weights) -> tuple[dict, tuple]:
    """{name: (launcher, fp32 reference of its own arithmetic)} for one input x [M, K], and the
    per-token-group codes, scales and reference the tile sweep reuses."""
    t_q, t_s = quantize_per_tensor_torch(x)
    r_q, r_s = rowwise(x)
    g_q, g_s = quantize_per_token_group_torch(x)
    g_q_cm, g_s_cm = quantize_per_token_group_torch(x, column_major_scales=True)
    ref_full = once(lambda: x.float() @ wt.w.float().t())
    ref_tensor = once(lambda: (t_q.float() * t_s) @ (wt.t_q.float() * wt.t_s).t())
    ref_row = once(lambda: (r_q.float() * r_s) @ (wt.r_q.float() * wt.r_s.t()).t())
    ref_block = once(lambda: dequantize_per_token_group(g_q, g_s) @ dequantize_weight_block_fp8(wt.b_q, wt.b_s).t())
    bf16 = torch.bfloat16
    cands = {
        "bf16": (lambda: F.linear(x, wt.w), ref_full),
        "tensor": (lambda: torch._scaled_mm(t_q, wt.t_q.t(), t_s, wt.t_s, out_dtype=bf16), ref_tensor),
        "tensor+q": (lambda: fp8_tensor_linear(x, wt.t_q, wt.t_s), ref_tensor),
        "row": (lambda: torch._scaled_mm(r_q, wt.r_q.t(), r_s, wt.r_s, out_dtype=bf16), ref_row),
        "cublas-blk": (lambda: scaled_mm_blockwise(g_q_cm, g_s_cm, wt.b_q, wt.b_s, bf16), ref_block),
        "cublas-blk+q": (lambda: scaled_mm_blockwise(*quantize_fp8_per_token_group(x, column_major_scales=True),
                                                     wt.b_q, wt.b_s, bf16), ref_block),
        "triton": (lambda: fp8_block_matmul(g_q, g_s, wt.b_q, wt.b_s, bf16), ref_block),
        "triton+q": (lambda: fp8_block_linear(x, wt.b_q, wt.b_s), ref_block),
    }
    return cands, (g_q, g_s, ref_block, ref_full)


def sweep(g_q, g_s, wt: Weights, ref: torch.Tensor, m: int):
    """(us, config) of the fastest correct SWEEP tile for this M, or (None, None)."""
    lo, hi = (16 if m <= 256 else 64), max(16, triton.next_power_of_2(m))
    best = (None, None)
    for bm, bn, gm, warps, stages in SWEEP:
        if not lo <= bm <= hi:
            continue
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=gm, num_warps=warps, num_stages=stages)
        launch = lambda: fp8_block_matmul(g_q, g_s, wt.b_q, wt.b_s, torch.bfloat16, config=cfg)
        try:
            if rel_err(launch(), ref) > WRONG:
                print(f"  sweep {cfg}: WRONG result, skipped")
                continue
            us = graph_us(launch)
        except Exception as e:  # e.g. out of shared memory for this tile
            print(f"  sweep {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            continue
        if best[0] is None or us < best[0]:
            best = (us, cfg)
    return best


def run(models: list[str], batches: list[int], tile_sweep: bool) -> list[dict]:
    """Time and check every candidate; print the table; return its rows."""
    header = f"{'gemm':>12} {'K':>6} {'N':>6} {'M':>5} " + " ".join(f"{c:>15}" for c in CANDIDATES)
    print(header + "  best triton tile")
    rows = []
    for model, gemm, k, n in SHAPES:
        if model not in models:
            continue
        wt = Weights(k, n)
        for m in batches:
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            cands, (g_q, g_s, ref_block, ref_full) = candidates(x, wt)
            result = {}
            for name, (launch, ref) in cands.items():
                row = dict(model=model, gemm=gemm, K=k, N=n, M=m, candidate=name)
                try:
                    out = launch()
                    row["rel_err"] = rel_err(out, ref())
                    row["rel_err_vs_full_precision"] = rel_err(out, ref_full())
                    del out
                    row["us"] = graph_us(launch)
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                rows.append(row)
                result[name] = row
            best = ""
            if tile_sweep:
                best_us, best_cfg = sweep(g_q, g_s, wt, ref_block(), m)
                rows.append(dict(model=model, gemm=gemm, K=k, N=n, M=m, candidate="triton-best", us=best_us,
                                 config=best_cfg))
                if best_us is not None:
                    best = f"{best_us:.1f} ({best_us / result['bf16']['us']:.2f}) " + " ".join(
                        f"{key}={val}" for key, val in best_cfg.items())
            cells = []
            for name in CANDIDATES:
                r = result[name]
                if "us" not in r:
                    cells.append(f"{'fails':>15}")
                    continue
                flag = "!" if r["rel_err"] > WRONG else " "
                cells.append(f"{r['us']:>7.1f}{flag}({r['us'] / result['bf16']['us']:4.2f})")
            print(f"{model + ' ' + gemm:>12} {k:>6} {n:>6} {m:>5} " + " ".join(cells) + "  " + best, flush=True)
            del x, cands
        del wt
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    for name, err in sorted({(r["candidate"], r["error"]) for r in rows if "error" in r}):
        print(f"{name} fails: {err}")
    for r in rows:
        if r.get("rel_err", 0) > WRONG:
            print(f"WRONG: {r['candidate']} {r['model']} {r['gemm']} M={r['M']}: rel err {r['rel_err']:.3g}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-sweep", action="store_true", help="skip the fp8_block_matmul tile sweep")
    parser.add_argument("--models", default="8b,0.6b", help="comma-separated: 8b, 0.6b")
    parser.add_argument("--m", default=",".join(map(str, BATCHES)), help="comma-separated token counts")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references; the timed GEMMs are bf16/fp8
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"default fp8_block_matmul configs {BLOCK_MATMUL_CONFIGS}")
    print("us per GEMM (ratio to bf16); '!' = result off its reference by > 1e-2 of max|ref|")
    rows = run(args.models.split(","), [int(v) for v in args.m.split(",")], not args.no_sweep)
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "fp8_gemm.json")
        with open(path, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           rows=rows), f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
