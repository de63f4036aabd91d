"""W4A16 GEMM in Triton: out[M, N] = x[M, K] @ W[K, N], W stored as 4-bit values q packed eight
to an int32 along K (qweight [K / 8, N]; value j of a word in bits 4j..4j+3) with per-group
scales s and zero points z [K / group_size, N]: W[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n].

The weights are unpacked in registers: each tile loads [BLOCK_K / 8, BLOCK_N] words (a word per
eight rows, re-read from L1 for each of them), shifts and masks, subtracts and scales in fp32 with
the group's row of s and z (a tile never straddles a group: BLOCK_K divides group_size), and
feeds the tensor cores in the activations' dtype. A decode-sized M reads each weight once, so the
kernel is bound by the 0.5 byte per weight; short, narrow tiles and split-K (partial sums added
atomically in fp32) give enough programs to pull the whole memory bandwidth at M = 1. Larger M
takes 64 x 128 tiles without split.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_xm, stride_om, group_size,
                  k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  ATOMIC: tl.constexpr):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // num_n, pid % num_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    k_start = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        words = tl.load(qw_ptr + (offs_k[:, None] // 8) * N + offs_n[None, :], mask=mask_k[:, None] & mask_n[None, :],
                        other=0)
        q = (words >> ((offs_k[:, None] % 8) * 4)) & 0xF
        group = k0 // group_size
        s = tl.load(s_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) - z[None, :]) * s[None, :]
        acc += tl.dot(x, w.to(x.dtype))
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if ATOMIC:
        tl.atomic_add(out, acc, mask=mask)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


_SMS: dict = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def _config(m: int, n: int, k: int, block_k: int, num_sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, splits, num_warps): decode-sized M splits K until about two programs
    per SM run; larger M takes wider tiles and no split."""
    if m > 64:
        return 64, 128, 1, 4
    block_m, block_n = 16, 64
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    splits = max(1, min(triton.cdiv(2 * num_sms, tiles), k // (4 * block_k)))
    return block_m, block_n, splits, 4


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, num_sms: int | None = None, config: tuple | None = None) -> torch.Tensor:
    """x [..., K] (fp16 / bf16 / fp32, contiguous rows) @ the unpacked weight [K, N] -> [..., N]
    in x's dtype. `group_size` must be a multiple of 32 dividing K (or K itself). `config`:
    (BLOCK_M, BLOCK_N, splits, num_warps) instead of _config's (benchmarks)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if x.shape[-1] != k or scales.shape != zeros.shape or scales.shape[1] != n:
        raise ValueError(f"w4a16_matmul: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, scales "
                         f"{tuple(scales.shape)}, zeros {tuple(zeros.shape)} do not fit")
    block_k = 64 if group_size % 64 == 0 else 32
    if group_size % block_k or k % group_size:
        raise ValueError(f"w4a16_matmul: group_size {group_size} must be a multiple of 32 dividing K = {k}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if num_sms is None:
        num_sms = _sm_count(x.device)
    block_m, block_n, splits, warps = config or _config(m, n, k, block_k, num_sms)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    out = torch.zeros(m, n, dtype=torch.float32, device=x.device) if splits > 1 else \
        torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n), splits)
    _w4a16_kernel[grid](x2, qweight, scales, zeros, out, m, n, k, x2.stride(0), out.stride(0), group_size,
                        k_per_split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, ATOMIC=splits > 1,
                        num_warps=warps)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)
