"""Prefill attention over a paged KV cache: each sequence's new query tokens attend (causally) to
its whole context read in place through the block table, a 16-bit or an FP8 e4m3 cache.

Why: a prefill with cached tokens (a prefix hit, or a chunk after the first of a long prompt)
attends to K/V that live only in the paged cache. aten's FlashAttention kernel takes contiguous
varlen K/V, so the Triton backend gathers every context into a copy first, and an FP8 cache is
also dequantized there with torch ops (through an fp32 copy of the group: up to 2^16 tokens
x 8 heads x 128 x 4 bytes for K and again for V). This kernel reads the cache where it lies and
widens e4m3 in registers, so neither copy exists.

Layout: q [T, H, D] (the step's new tokens packed by cu_seqlens_q), caches [blocks, block_size,
KVH, D], block_tables [S, max_blocks], context_lens [S] (each sequence's K/V length after the
step, its new tokens included: the backend stores them before attending). Query j of a
sequence with q_len new tokens sits at absolute position ctx - q_len + j and sees tokens
0 .. that position (the bottom-right causal mask of TorchBackend).

FP8: a cached value is stored * scale rounded to q's dtype before it meets q, as the reference
(fp8_cache.dequantize_kv) rounds it, so both read the same K and V. The softmax is the usual
online one in fp32 (log2 domain), one program per (query tile, head, sequence).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.kv_store import check_kv_scales, check_paged_cache

_LOG2E = 1.4426950408889634


@triton.jit
def _kv_tile(cache_ptr, rows, col, tok_mask, scale_ptr, KV_FP8: tl.constexpr, dtype: tl.constexpr):
    """A [BLOCK_N, D] tile of K or V at the cache rows `rows`, in q's dtype (FP8: times the scale,
    rounded to it as the reference dequantizes)."""
    x = tl.load(cache_ptr + rows[:, None] + col[None, :], mask=tok_mask[:, None], other=0.0)
    if KV_FP8:
        x = (x.to(tl.float32) * tl.load(scale_ptr)).to(dtype)
    return x


@triton.jit
def paged_prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, cu_q_ptr, ctx_ptr, bt_ptr, k_scale_ptr,
                         v_scale_ptr, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_block,
                         stride_token, stride_bt, GROUP: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Queries m0 .. m0 + BLOCK_M of sequence `seq`, head `head`: grid (query tiles, H, S)."""
    m0 = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if m0 >= q_len:
        return
    ctx = tl.load(ctx_ptr + seq)
    dtype = q_ptr.dtype.element_ty
    rows = m0 + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    qpos = ctx - q_len + tl.minimum(rows, q_len - 1)  # (rows past the end copy the last one's)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_mask[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    col = (head // GROUP) * HEAD_DIM + dims
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    end = tl.minimum(ctx, ctx - q_len + m0 + BLOCK_M)  # past the tile's last query nothing is seen
    for n0 in range(0, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        tok_mask = tok < end
        phys = tl.load(bt_row + tok // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
        cache_rows = phys * stride_block + (tok % BLOCK_SIZE) * stride_token
        k = _kv_tile(k_cache_ptr, cache_rows, col, tok_mask, k_scale_ptr, KV_FP8, dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(tok_mask[None, :] & (tok[None, :] <= qpos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: token 0 is seen by every row
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        v = _kv_tile(v_cache_ptr, cache_rows, col, tok_mask, v_scale_ptr, KV_FP8, dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(dtype), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(dtype), mask=row_mask[:, None])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            max_seqlen_q: int, scale: float, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, block_m: int = 64,
                            block_n: int = 64) -> torch.Tensor:
    """Causal attention of the packed new tokens q [T, H, D] over their sequences' paged
    contexts (see the module docstring); [T, H, D] in q's dtype."""
    check_paged_cache(k_cache, v_cache)
    kv_fp8 = check_kv_scales(k_cache, k_scale, v_scale)
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q must be [T, H, {k_cache.shape[3]}] with H a multiple of the cache's "
                         f"{k_cache.shape[2]} kv heads, got {tuple(q.shape)}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    seqs = cu_seqlens_q.numel() - 1
    if seqs <= 0 or q.shape[0] == 0 or max_seqlen_q <= 0:
        return out
    heads, head_dim = q.shape[1], q.shape[2]
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(max_seqlen_q, block_m), heads, seqs)
    paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables,
        k_scale if kv_fp8 else q, v_scale if kv_fp8 else q, scale * _LOG2E, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        GROUP=heads // k_cache.shape[2], HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, KV_FP8=kv_fp8, DOT_PRECISION=precision)
    return out
