"""Experiment: the tensor-core W4A16 kernel (kernels/w4a16_mma.py) with the weight prepacked so
that the unpacked tile lands in wgmma's register-operand layout with no data movement.

    PYTHONPATH=. python3 benchmarks/kernels/bench_w4a16_perm.py [--m 16,32,64,128,256]

Why: compiled for sm90 (on the CPU machine), Mma's loop stores each unpacked [64, 128] tile to
shared memory and reads it back with ldmatrix (8 st.shared.v4 + 8 ldmatrix + ~11 bar.sync a
step), because a word's eight nibbles are eight consecutive K-rows in one thread while wgmma's
A fragment gives a thread K-pairs {2l, 2l + 1, 2l + 8, 2l + 9} (l = lane % 4). Prepacked so that
word t (0..3) of each 32-row block holds K-rows 2t + {0, 1, 8, 9, 16, 17, 24, 25}, the tile
reshaped and permuted in registers is that fragment: the loop keeps no shared-memory round trip
(0 st.shared, 2 bar.sync). x's loads stay contiguous (the dot sees K in its natural order).

Per GEMM of Qwen3-8B and M: bf16 F.linear, today's launch (`choose`), and the best prepacked
launch of a sweep, each output checked against x @ the dequantized weight in fp32 first.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from timing import cuda_graph_us  # benchmarks/kernels/timing.py (this folder)
from nanovllm.features.quantization.int4_formats import dequantize
from nanovllm.kernels.w4a16 import choose, w4a16_matmul
from nanovllm.kernels.w4a16_mma import _join8, _nibble, _nibbles_asm

import bench_w4a16

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def prepack(qweight: torch.Tensor) -> torch.Tensor:
    """Natural words (nibble j of word i = K-row 8i + j) -> the fragment order: nibble
    j = 4a + 2b + c of word 4 * blk + t holds K-row 32 * blk + 16a + 8b + 2t + c."""
    k8, n = qweight.shape
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    q = (qweight[:, None, :] >> shifts[None, :, None]) & 0xF  # [K / 8, 8, N]: K-row 8i + j
    q = q.reshape(k8 // 4, 2, 2, 4, 2, n).permute(0, 3, 1, 2, 4, 5).reshape(k8, 8, n)  # (blk, t, a, b, c)
    return _pack(q, shifts)


def _pack(q: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """[W, 8, N] nibbles -> [W, N] int32 words (nibble j at bits 4j)."""
    words = (q.to(torch.int64) << shifts.to(torch.int64)[None, :, None]).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@triton.jit
def perm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_xm, stride_om, k_per_split,
                GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                ASM: tl.constexpr, ATOMIC: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_w = tl.arange(0, BLOCK_K // 8)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    k_start = tl.program_id(2) * k_per_split
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # out^T
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        w2, n2, mn = (k0 // 8 + offs_w)[None, :], offs_n[:, None], mask_n[:, None]
        words = tl.load(qw_ptr + w2 * N + n2, mask=mn, other=0)
        sz = (k0 // GROUP) * N + n2  # (GROUP % BLOCK_K == 0: one group a tile)
        s = tl.load(s_ptr + sz, mask=mn, other=0.0)
        z = tl.load(z_ptr + sz, mask=mn, other=0.0)
        if ASM:
            v0, v1, v2, v3, v4, v5, v6, v7 = _nibbles_asm(words, s, z, x_ptr.dtype.element_ty)
        else:
            sf, zc, dt = s.to(tl.float32), z.to(tl.float32) + 128.0, x_ptr.dtype.element_ty
            v0, v1, v2, v3 = (_nibble(words, sf, zc, 0, dt), _nibble(words, sf, zc, 1, dt),
                              _nibble(words, sf, zc, 2, dt), _nibble(words, sf, zc, 3, dt))
            v4, v5, v6, v7 = (_nibble(words, sf, zc, 4, dt), _nibble(words, sf, zc, 5, dt),
                              _nibble(words, sf, zc, 6, dt), _nibble(words, sf, zc, 7, dt))
        v = tl.reshape(_join8(v0, v1, v2, v3, v4, v5, v6, v7), (BLOCK_N, BLOCK_K // 32, 2, 2, 2, 2, 2))
        v = tl.permute(v, (0, 1, 4, 5, 2, 3, 6))  # (n, blk, t1, t0, a, b, c) -> K-row order
        w = tl.reshape(v, (BLOCK_N, BLOCK_K))
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + (k0 + offs_k)[:, None], mask=mask_m[None, :], other=0.0)
        acc = tl.dot(w, xt, acc)
    out = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    mask = mask_m[None, :] & mask_n[:, None]
    if ATOMIC:
        tl.atomic_add(out, acc, mask=mask)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def perm_matmul(x2, qw_perm, scales, zeros, group, cfg):
    """cfg = (block_m, block_n, block_k, splits, warps, stages)."""
    bm, bn, bk, splits, warps, stages = cfg
    m, k, n = x2.shape[0], x2.shape[1], qw_perm.shape[1]
    k_per_split = triton.cdiv(k // bk, splits) * bk
    splits = triton.cdiv(k, k_per_split)
    out = torch.zeros(m, n, dtype=torch.float32, device=x2.device) if splits > 1 else \
        torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    perm_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm), splits)](
        x2, qw_perm, scales, zeros, out, m, n, k, x2.stride(0), out.stride(0), k_per_split, GROUP=group,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, ASM=not INTERPRETED, ATOMIC=splits > 1, num_warps=warps,
        num_stages=stages)
    return out.to(x2.dtype)


def candidates(m: int) -> list[tuple]:
    if m <= 64:
        bms = (16,) if m <= 16 else (32,) if m <= 32 else (32, 64)
        return [(bm, bn, 128, sp, bn // 16, st) for bm in bms for bn in (64, 128) for sp in (1, 2, 4) for st in (3,)]
    # 128 columns take 8 warps: at 4 the sm90 loop spills the tile through shared memory
    return [(bm, bn, bk, sp, bn // 16, st) for bm in (64, 128, 256) for bn in (64, 128) for bk in (64, 128)
            for sp in (1,) for st in (3, 4) if bm * bn <= 128 * 128]


def row(name: str, k: int, n: int, m: int, gen) -> dict:
    w, next_w = bench_w4a16.rotating(lambda: bench_w4a16.weights(k, n, 128, gen), k * n // 2)
    perms = {id(v.qweight): prepack(v.qweight) for v in [w] + [next_w() for _ in range(16)]}
    x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    dense, next_dense = bench_w4a16.rotating(lambda: dequantize(w).to(torch.bfloat16).t().contiguous(), k * n * 2)
    ref = x.float() @ dequantize(w)
    err = lambda out: ((out.float() - ref).abs().max() / ref.abs().max()).item()  # noqa: E731
    res = {"gemm": name, "k": k, "n": n, "m": m, "bf16_us": cuda_graph_us(lambda: F.linear(x, next_dense()), median=True)}
    res["choose"] = str(tuple(choose(m, n, k)))
    res["today_err"] = err(w4a16_matmul(x, w.qweight, w.scales, w.zeros, 128))
    res["today_us"] = cuda_graph_us(lambda: (lambda v: w4a16_matmul(x, v.qweight, v.scales, v.zeros, 128))(next_w()),
                                    median=True)
    timed, wrong = [], []
    for cfg in candidates(m):
        try:
            e = err(perm_matmul(x, perms[id(w.qweight)], w.scales, w.zeros, 128, cfg))
            if e > 1e-2:
                wrong.append((cfg, e)); continue
            us = cuda_graph_us(lambda: (lambda v: perm_matmul(x, perms[id(v.qweight)], v.scales, v.zeros, 128, cfg))(
                next_w()), median=True)
            timed.append((us, cfg))
        except triton.runtime.errors.OutOfResources:
            continue
    res["wrong"] = wrong
    if timed:
        res["perm_us"], res["perm_cfg"] = min(timed)
        res["top3"] = sorted(timed)[:3]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="16,32,64,128,256")
    ap.add_argument("--gemms", default="qkv,o,gate_up,down")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'gemm':<8}{'M':>5}{'bf16':>8}{'today':>8}{'perm':>8}{'perm/today':>11}  perm config (bm,bn,bk,splits,warps,stages)")
    rows = []
    for m in args.m.split(","):
        for g in args.gemms.split(","):
            r = row(g, *bench_w4a16.GEMMS[g], int(m), gen)
            rows.append(r)
            p = r.get("perm_us")
            print(f"{r['gemm']:<8}{r['m']:>5}{r['bf16_us']:>8.1f}{r['today_us']:>8.1f}{(p or 0):>8.1f}"
                  f"{(p / r['today_us'] if p else 0):>11.2f}  {r.get('perm_cfg')} wrong={len(r['wrong'])}", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "w4a16_perm.json"), "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
