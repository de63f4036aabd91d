"""W4A16 GEMM in Triton: out[M, N] = x[M, K] @ W[K, N], W stored as 4-bit values q packed eight
to an int32 along K (qweight [K / 8, N]; value j of a word in bits 4j..4j+3) with per-group
scales s and zero points z [K / group_size, N]: W[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n].

The weights are unpacked in registers, never reshaped: a tile loads its [BLOCK_K / 8, BLOCK_N]
words once, with one scale and zero-point row per word row (a word's eight rows share a group),
and for each of the eight nibbles j makes the rows 8i + j: q * s - z * s in fp32 (one FMA a
weight), which meet the matching columns of x in a tensor-core product of depth BLOCK_K / 8. A
decode-sized M reads each weight once, so the kernel is bound by the 0.5 byte per weight: deep
tiles and split-K (partial sums added atomically in fp32) keep enough bytes in flight at M = 1.
Larger M shares each unpacked tile among 128 rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, stride_xm, stride_om, k_per_split,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  ATOMIC: tl.constexpr):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = pid // num_n, pid % num_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_K // 8)  # the tile's words along K: word i holds rows 8i .. 8i + 7
    mask_m, mask_n = offs_m < M, offs_n < N
    k_start = tl.program_id(1) * k_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        words = tl.load(qw_ptr + (k0 // 8 + offs_w)[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0)
        # Rows 8i .. 8i + 7 share a group (GROUP is a multiple of 8): one scale / zero row per word row.
        sz = ((k0 + 8 * offs_w) // GROUP)[:, None] * N + offs_n[None, :]
        s = tl.load(s_ptr + sz, mask=mask_n[None, :], other=0.0).to(tl.float32)
        zs = tl.load(z_ptr + sz, mask=mask_n[None, :], other=0.0).to(tl.float32) * s
        for j in tl.static_range(8):  # rows 8i + j of the tile: a [BLOCK_K / 8]-deep product each
            w = ((words >> (4 * j)) & 0xF).to(tl.float32) * s - zs
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + 8 * offs_w + j)[None, :], mask=mask_m[:, None],
                        other=0.0)
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


def _config(m: int, n: int, k: int, num_sms: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, splits, num_warps). Decode-sized M is bound by reading the
    weights: 256-deep tiles (8 KiB of words per load) and K split until about four programs per
    SM keep enough bytes in flight. Larger M shares each unpacked tile among more rows."""
    block_k = 256 if k % 256 == 0 else 128
    if m <= 16:
        block_m, block_n, warps, per_sm = 16, 64, 4, 4
    elif m <= 64:
        block_m, block_n, warps, per_sm, block_k = 64, 64, 4, 2, 128
    else:
        return 128, 128, 128, 1, 8
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    return block_m, block_n, block_k, max(1, min(triton.cdiv(per_sm * num_sms, tiles), k // block_k)), warps


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, num_sms: int | None = None, config: tuple | None = None) -> torch.Tensor:
    """x [..., K] (fp16 / bf16 / fp32) @ the unpacked weight [K, N] -> [..., N] in x's dtype. K
    must be a multiple of 128 and `group_size` a multiple of 8 dividing K (supported: can_run).
    `config`: (BLOCK_M, BLOCK_N, BLOCK_K, splits, num_warps) instead of _config's (benchmarks)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if x.shape[-1] != k or scales.shape != zeros.shape or scales.shape[1] != n or not can_run(k, group_size):
        raise ValueError(f"w4a16_matmul: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, scales "
                         f"{tuple(scales.shape)}, zeros {tuple(zeros.shape)}, group_size {group_size} do not fit")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    block_m, block_n, block_k, splits, warps = config or _config(m, n, k, num_sms or _sm_count(x.device))
    k_per_split = triton.cdiv(k // block_k, splits) * block_k
    splits = triton.cdiv(k, k_per_split)
    if k % k_per_split:  # (every split whole tiles: the kernel has no mask along K)
        k_per_split, splits = block_k, k // block_k
    out = torch.zeros(m, n, dtype=torch.float32, device=x.device) if splits > 1 else \
        torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n), splits)
    _w4a16_kernel[grid](x2, qweight, scales, zeros, out, m, n, x2.stride(0), out.stride(0), k_per_split,
                        GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, ATOMIC=splits > 1,
                        num_warps=warps, num_stages=3)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def can_run(k: int, group_size: int) -> bool:
    """Whether the kernel takes a weight of K input features in groups of `group_size`."""
    return k % 128 == 0 and group_size % 8 == 0 and k % group_size == 0
