"""Experiment: a fused W4A16 GEMM for 128-256 rows (x [M, K] @ W [K, N], W unpacked tile by tile
into registers, then through shared memory into wgmma), against bf16 cuBLAS and kernels/w4a16.py's
dequantize + cuBLAS, on Qwen3-8B's shapes.

    PYTHONPATH=. python3 benchmarks/kernels/w4a16_large_m.py

Two ways to order a tile's K-rows: JOIN lays the eight nibble tensors out in K order (a permute
through shared memory); KPERM stacks them nibble-major and gathers x's columns in that order
(the dot sums over K in any order), so W needs no permute but x's loads are strided.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from timing import cuda_graph_us  # benchmarks/kernels/timing.py (this folder)
from nanovllm.features.quantization.int4_formats import dequantize
from nanovllm.kernels.w4a16 import Dequant, w4a16_matmul
from nanovllm.kernels.w4a16_mma import _nibbles_asm

import bench_w4a16


@triton.jit
def _stack0(a, b):
    """[R, C] twice -> [2R, C]: a's rows, then b's."""
    return tl.reshape(tl.permute(tl.join(a, b), (2, 0, 1)), (2 * a.shape[0], a.shape[1]))


@triton.jit
def large_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_xm, stride_om, GROUP: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KPERM: tl.constexpr, SWIZZLE: tl.constexpr):
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    width = SWIZZLE * grid_m  # programs sharing a band of N columns run together (W tiles reused from L2)
    band = pid // width
    pid_n = band * SWIZZLE + (pid % width) % SWIZZLE
    pid_m = (pid % width) // SWIZZLE
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_w = tl.arange(0, BK // 8)
    mask_m = offs_m < M
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if KPERM:  # column c of the tile: K-row 8 * (c % (BK / 8)) + c // (BK / 8)
        cols = 8 * (tl.arange(0, BK) % (BK // 8)) + tl.arange(0, BK) // (BK // 8)
    else:
        cols = tl.arange(0, BK)
    for k0 in range(0, K, BK):
        words = tl.load(qw_ptr + (k0 // 8 + offs_w)[:, None] * N + offs_n[None, :])
        s = tl.load(s_ptr + (k0 // GROUP) * N + offs_n)[None, :]
        z = tl.load(z_ptr + (k0 // GROUP) * N + offs_n)[None, :]
        v0, v1, v2, v3, v4, v5, v6, v7 = _nibbles_asm(words, s, z, tl.bfloat16)
        if KPERM:
            w = _stack0(_stack0(_stack0(v0, v1), _stack0(v2, v3)), _stack0(_stack0(v4, v5), _stack0(v6, v7)))
        else:
            j = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
            w = tl.reshape(tl.permute(j, (0, 2, 3, 4, 1)), (BK, BN))
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + cols)[None, :], mask=mask_m[:, None], other=0.0)
        acc = tl.dot(x, w, acc)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None])


def large(x, w, cfg):
    bm, bn, bk, kperm, warps, stages = cfg
    m, k = x.shape
    n = w.qweight.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    large_kernel[grid](x, w.qweight, w.scales, w.zeros, out, m, n, k, x.stride(0), out.stride(0), GROUP=128,
                       BM=bm, BN=bn, BK=bk, KPERM=kperm, SWIZZLE=8, num_warps=warps, num_stages=stages)
    return out


CONFIGS = [(bm, bn, bk, kp, wp, st) for kp in (0, 1) for bm, bn, bk, wp in
           ((64, 128, 64, 4), (128, 128, 64, 8), (128, 256, 64, 8), (64, 256, 64, 8), (128, 128, 128, 8))
           for st in (3, 4)]


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'gemm':<8}{'M':>5}{'bf16':>8}{'dequant':>9}{'best':>8}  config (us; x = bf16 / best)")
    for m, (name, (k, n)) in itertools.product((128, 256), bench_w4a16.GEMMS.items()):
        w, next_w = bench_w4a16.rotating(lambda: bench_w4a16.weights(k, n, 128, gen), k * n // 2)
        dense, next_dense = bench_w4a16.rotating(lambda: dequantize(w).to(torch.bfloat16).t().contiguous(), k * n * 2)
        x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
        ref = x.float() @ dequantize(w)
        bf16 = cuda_graph_us(lambda: F.linear(x, next_dense()), median=True)
        deq = cuda_graph_us(lambda: (lambda v: w4a16_matmul(x, v.qweight, v.scales, v.zeros, 128, config=Dequant()))(
            next_w()), median=True)
        timed, wrong = [], []
        for cfg in CONFIGS:
            try:
                got = large(x, w, cfg)
            except Exception as e:  # (a tile too large for shared memory, a layout Triton refuses)
                wrong.append((cfg, type(e).__name__))
                continue
            if ((got.float() - ref).abs().max() / ref.abs().max()).item() > 1e-2:
                wrong.append((cfg, "WRONG"))
                continue
            timed.append((cuda_graph_us(lambda: large(x, next_w(), cfg), median=True), cfg))
        best = min(timed) if timed else (float("nan"), None)
        print(f"{name:<8}{m:>5}{bf16:>8.1f}{deq:>9.1f}{best[0]:>8.1f}  {best[1]} x{bf16 / best[0]:.2f}  "
              f"kperm best {min((t for t, c in timed if c[3]), default=float('nan')):.1f} "
              f"join best {min((t for t, c in timed if not c[3]), default=float('nan')):.1f} failed {wrong[:4]}")


if __name__ == "__main__":
    main()
