"""Triton kernels (CUDA; CPU tests run them in Triton's interpreter). Each module imports Triton,
an optional dependency, so the model imports them inside its CUDA branches; this package's own
names are plain torch."""

import torch


def one_row(x: torch.Tensor) -> bool:
    """One 16-bit CUDA row, the input of dense_gemv.py's batch-1 GEMV (cuBLAS takes ~5 us for any
    small-M GEMM; BENCHMARKS.md "Batch-1 steps")."""
    return x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)
