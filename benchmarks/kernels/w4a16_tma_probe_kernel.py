"""The kernel of w4a16_tma_probe.py (an experiment, not the engine's): kernels/w4a16_mma.py's
tensor-core GEMM with x's tile and the words brought by TMA descriptors (one copy instruction a
tile instead of a cp.async, an address and a mask per thread and row; rows past M and columns
past N arrive as zeros); the unpacking is the engine's (w4a16_mma.unpack_tile)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm.kernels.w4a16_mma import INTERPRETED, Mma, unpack_tile


@triton.jit(do_not_specialize=["M"])
def mma_tma_kernel(x_desc, w_desc, s_ptr, z_ptr, out_ptr, M, N, K, stride_om, k_per_split,
                   GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   ASM: tl.constexpr, ATOMIC: tl.constexpr):
    n0, m0 = tl.program_id(0) * BLOCK_N, tl.program_id(1) * BLOCK_M
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k_start = tl.program_id(2) * k_per_split
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # out^T
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        words = tl.trans(w_desc.load([k0 // 8, n0]))  # [BLOCK_N, BLOCK_K / 8]
        sz = (k0 // GROUP) * N + offs_n[:, None]  # (groups of whole K-tiles only: GROUP % BLOCK_K == 0)
        s = tl.load(s_ptr + sz, mask=mask_n[:, None], other=0.0)
        z = tl.load(z_ptr + sz, mask=mask_n[:, None], other=0.0)
        w = unpack_tile(words, s, z, BLOCK_K, ASM, x_desc.dtype)
        acc = tl.dot(w, tl.trans(x_desc.load([m0, k0])), acc)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    out = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    mask = (offs_m < M)[None, :] & mask_n[:, None]
    if ATOMIC:
        tl.atomic_add(out, acc, mask=mask)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def mma_tma(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
            cfg: Mma) -> torch.Tensor:
    """x2 [M, K] @ the unpacked weight -> [M, N] in x2's dtype (group_size a multiple of block_k)."""
    m, k, n = x2.shape[0], x2.shape[1], qweight.shape[1]
    k_per_split = triton.cdiv(k // cfg.block_k, cfg.splits) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)
    out = torch.zeros(m, n, dtype=torch.float32, device=x2.device) if splits > 1 else \
        torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    x_desc = TensorDescriptor.from_tensor(x2, [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(qweight, [cfg.block_k // 8, cfg.block_n])
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), splits)
    mma_tma_kernel[grid](x_desc, w_desc, scales, zeros, out, m, n, k, out.stride(0), k_per_split,
                         GROUP=group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                         ASM=not INTERPRETED, ATOMIC=splits > 1, num_warps=cfg.warps, num_stages=cfg.stages)
    return out.to(x2.dtype) if splits > 1 else out
