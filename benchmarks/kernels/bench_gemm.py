"""cuBLAS on the decode GEMMs of Qwen3-8B at TP=1 and TP=2, against split-K done in plain PyTorch.

    PYTHONPATH=. python3 benchmarks/kernels/bench_gemm.py [--blas]

For each weight shape (qkv, o, gate_up, down; per rank) and batch size M, times F.linear and a
split-K variant (x and W cut into S slices along K, one batched GEMM writing S partial outputs,
then their sum), all from CUDA graphs. Prints microseconds and the floor of each shape: the
larger of weight bytes / 4.3 TB/s and FLOPs / 989 TFLOP/s.

--blas instead times F.linear through cuBLAS and through cuBLASLt (torch's preferred BLAS
library) with a cold L2 (a 256 MiB read before each call, its own time subtracted), as the
engine's decode graphs see the weights; the engine captures them with the faster overall
(cuBLASLt, core/cuda_graphs.py). Prints both and the totals per TP degree.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from timing import cuda_graph_us, qwen3_8b_gemms  # benchmarks/kernels/timing.py (this folder)

BATCHES = (1, 16, 64, 96, 128, 192, 256)


def split_k(x: torch.Tensor, w: torch.Tensor, s: int) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    parts = torch.bmm(x.view(m, s, k // s).transpose(0, 1), w.view(n, s, k // s).permute(1, 2, 0))
    return parts.sum(0)


def blas_libraries() -> None:
    flush = torch.empty(128 << 20, device="cuda", dtype=torch.bfloat16).normal_()  # 256 MiB, evicts L2
    libs = ("cublas", "cublaslt")
    before = torch.backends.cuda.preferred_blas_library()
    totals = {}
    print(f"{'tp':>3}{'gemm':>8}{'M':>5}" + "".join(f"{lib:>10}" for lib in libs))
    for tp in (2, 1):
        for name, k, n in qwen3_8b_gemms(tp):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            for m in (8, 32, 64, 96, 128, 160, 192, 224, 256):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                t = {}
                for lib in libs:
                    torch.backends.cuda.preferred_blas_library(lib)  # read when the graph is captured
                    t[lib] = (cuda_graph_us(lambda: (flush.amax(), F.linear(x, w)), 10, 10)
                              - cuda_graph_us(lambda: flush.amax(), 10, 10))
                    totals[tp, lib] = totals.get((tp, lib), 0.0) + t[lib]
                print(f"{tp:>3}{name:>8}{m:>5}" + "".join(f"{t[lib]:>10.1f}" for lib in libs), flush=True)
    torch.backends.cuda.preferred_blas_library(before)
    for tp in (2, 1):
        print(f"TP={tp} total over the shapes above: " + ", ".join(f"{lib} {totals[tp, lib]:.0f} us" for lib in libs))


def main() -> None:
    torch.manual_seed(0)
    if "--blas" in sys.argv[1:]:
        blas_libraries()
        return
    print(f"{'tp':>3}{'gemm':>8}{'M':>5}{'floor':>8}{'linear':>8}{'sk2':>8}{'sk4':>8}{'best':>6}")
    for tp in (1, 2):
        for name, k, n in qwen3_8b_gemms(tp):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            for m in BATCHES:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                floor = max(n * k * 2 / 4.3e12, 2 * m * n * k / 989e12) * 1e6
                t = {"linear": cuda_graph_us(lambda: F.linear(x, w), 36, 20)}
                for s in (2, 4):
                    err = (split_k(x, w, s).float() - F.linear(x, w).float()).abs().max().item()
                    if err > 0.1:
                        raise SystemExit(f"split-K {s} is wrong: max error {err}")
                    t[f"sk{s}"] = cuda_graph_us(lambda: split_k(x, w, s), 36, 20)
                best = min(t, key=t.get)
                print(f"{tp:>3}{name:>8}{m:>5}{floor:>8.1f}{t['linear']:>8.1f}{t['sk2']:>8.1f}{t['sk4']:>8.1f}{best:>6}")


if __name__ == "__main__":
    main()
