"""Can a Triton GEMM keep up with cuBLAS on the row-parallel decode GEMMs of Qwen3-8B at TP=2?

    PYTHONPATH=.:scripts python3 scripts/bench_triton_gemm.py

The question behind it: the decode all-reduces cost TP=2 ~0.7 s of the bench (BENCHMARKS.md).
A GEMM of our own could push each finished output tile into the peer's buffer from its epilogue,
so the all-reduce's transfer would hide behind the GEMM. That only pays if the GEMM itself is
within ~10% of cuBLAS. This times a plain tiled Triton GEMM (y = x @ W^T, bf16 in, fp32
accumulation, bf16 out; the best of a small grid of tile configs per shape) against F.linear
for o_proj (K=2048) and down_proj (K=6144) into hidden 4096, M = 1-256, from CUDA graphs.
For M <= 64 it also times a split-K variant (narrow tiles, K in 1-8 slices, fp32 partials).

Measured 2026-11-30 (2xH200 call, plain tiles only): 1.1-1.7x cuBLAS's time, e.g. down_proj at
M = 1: 23.7 against 14.9 us (BENCHMARKS.md). The split-K rows have not run on a GPU yet.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from timing import HIDDEN, cuda_graph_us, row_parallel_gemms  # scripts/timing.py

BATCHES = (1, 8, 16, 64, 128, 192, 256)
CONFIGS = [dict(BM=bm, BN=bn, BK=64, num_stages=s, num_warps=w)
           for bm, bn, s, w in itertools.product((16, 64, 128), (64, 128), (3, 5), (4, 8))]
# Skinny M: BN = 64 leaves 64 programs for 132 SMs (N = 4096), too few to draw the weight-read
# rate. Narrower tiles and K slices give 128-1024 programs.
SPLIT_K_BATCHES = (1, 8, 16, 64)
SPLIT_K_CONFIGS = [dict(BM=16, BN=bn, BK=bk, SPLIT_K=sk, num_stages=4, num_warps=4)
                   for bn, bk, sk in itertools.product((32, 64), (64, 128), (1, 2, 4, 8))]


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out, slice_stride,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr):
    """out[s] = x[:, ks] @ w[:, ks]^T over the s-th of SPLIT_K equal slices ks of K (x [M, K],
    w [N, K], out[s] rows `stride_out` apart, slices `slice_stride` apart), accumulated in fp32
    and stored in out's dtype. Grid (cdiv(N, BN), cdiv(M, BM), SPLIT_K); K / SPLIT_K a multiple
    of BK. SPLIT_K = 1 is the plain GEMM."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    k_per = K // SPLIT_K
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    ks = pid_k * k_per + tl.arange(0, BK)
    x_tile = x_ptr + rows[:, None] * stride_x + ks[None, :]
    w_tile = w_ptr + cols[:, None] * stride_w + ks[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for _ in range(0, k_per, BK):
        a = tl.load(x_tile, mask=rows[:, None] < M, other=0.0)
        b = tl.load(w_tile, mask=cols[:, None] < N, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        x_tile += BK
        w_tile += BK
    out = out_ptr + pid_k.to(tl.int64) * slice_stride + rows[:, None] * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, slice_stride: int, cfg: dict) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    split_k = cfg.get("SPLIT_K", 1)
    grid = (triton.cdiv(n, cfg["BN"]), triton.cdiv(m, cfg["BM"]), split_k)
    _gemm_kernel[grid](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(-2), slice_stride, BM=cfg["BM"],
                       BN=cfg["BN"], BK=cfg["BK"], SPLIT_K=split_k, num_stages=cfg["num_stages"],
                       num_warps=cfg["num_warps"])
    return out


def triton_linear(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cfg: dict) -> torch.Tensor:
    """y = x @ w^T in y's dtype (cfg without SPLIT_K)."""
    return _launch(x, w, y, 0, cfg)


def triton_split_k(x: torch.Tensor, w: torch.Tensor, part: torch.Tensor, cfg: dict) -> torch.Tensor:
    """part: fp32 [SPLIT_K, M, N], filled with the K slices' partial products: what a push
    epilogue would send (the norm after it sums them), so no reduction is timed here."""
    return _launch(x, w, part, part.stride(0), cfg)


def main() -> None:
    torch.manual_seed(0)
    print(f"{'gemm':>10}{'M':>5}{'cublas us':>11}{'triton us':>11}{'ratio':>7}  best config "
          "(split-K rows: fp32 partial products per K slice, not summed)")
    for name, k in row_parallel_gemms(2):
        w = torch.randn(HIDDEN, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        for m in BATCHES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, w).float()
            cublas = cuda_graph_us(lambda: F.linear(x, w), 36, 20)
            best, best_cfg = fastest(CONFIGS, lambda cfg: plain(x, w, y, cfg), lambda out: out.float(), want,
                                     f"{name} M={m}")
            print(f"{name:>10}{m:>5}{cublas:>11.1f}{best:>11.1f}{best / cublas:>7.2f}  {best_cfg}")
            if m in SPLIT_K_BATCHES:
                best, best_cfg = fastest(SPLIT_K_CONFIGS, lambda cfg: split_k(x, w, cfg), lambda out: out.sum(0), want,
                                         f"{name} split-K M={m}")
                print(f"{name + ' sk':>10}{m:>5}{cublas:>11.1f}{best:>11.1f}{best / cublas:>7.2f}  {best_cfg}")


def plain(x, w, y, cfg):
    """A launcher of the plain GEMM into y (poisoned first), or None for tiles taller than the
    batch (they only add padding)."""
    if cfg["BM"] > max(16, triton.next_power_of_2(x.shape[0])):
        return None
    y.fill_(float("nan"))
    return lambda: triton_linear(x, w, y, cfg)


def split_k(x, w, cfg):
    """A launcher of the split-K GEMM into fresh NaN partials, or None if K does not split into
    whole BK tiles."""
    if (x.shape[1] // cfg["SPLIT_K"]) % cfg["BK"]:
        return None
    part = torch.full((cfg["SPLIT_K"], x.shape[0], w.shape[0]), float("nan"), device=x.device)
    return lambda: triton_split_k(x, w, part, cfg)


def fastest(configs, make, result, want: torch.Tensor, what: str) -> tuple[float, dict]:
    """The fastest of `configs` in us: make(cfg) gives a launcher (or None: skip), whose output,
    through result(), must match `want`."""
    best, best_cfg = float("inf"), None
    for cfg in configs:
        launch = make(cfg)
        if launch is None:
            continue
        try:
            got = result(launch())
        except triton.runtime.errors.OutOfResources:  # too much shared memory for this tile
            continue
        if not torch.allclose(got, want, rtol=2e-2, atol=2e-2):
            raise SystemExit(f"{what} {cfg}: wrong result")
        us = cuda_graph_us(launch, 36, 10)
        if us < best:
            best, best_cfg = us, cfg
    return best, best_cfg


if __name__ == "__main__":
    main()
