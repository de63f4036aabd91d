"""cuBLAS on the decode GEMMs of Qwen3-8B at TP=1 and TP=2, against split-K done in plain PyTorch.

    PYTHONPATH=. python3 scripts/bench_gemm.py

For each weight shape (qkv, o, gate_up, down; per rank) and batch size M, times F.linear and a
split-K variant (x and W cut into S slices along K, one batched GEMM writing S partial outputs,
then their sum), all from CUDA graphs. Prints microseconds and the floor of each shape: the
larger of weight bytes / 4.3 TB/s and FLOPs / 989 TFLOP/s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from timing import cuda_graph_us, qwen3_8b_gemms  # scripts/timing.py

BATCHES = (1, 16, 64, 96, 128, 192, 256)


def split_k(x: torch.Tensor, w: torch.Tensor, s: int) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    parts = torch.bmm(x.view(m, s, k // s).transpose(0, 1), w.view(n, s, k // s).permute(1, 2, 0))
    return parts.sum(0)


def main() -> None:
    torch.manual_seed(0)
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
