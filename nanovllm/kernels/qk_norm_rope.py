"""Per-head q/k RMSNorm (optional: models without q/k norm) + NeoX rotary in one Triton kernel,
straight from the packed qkv projection; optionally storing k and v into the paged KV cache in
the same launch (kernels/kv_store.py's store, bitwise, FP8 cache included).

Rounds as the plain-torch RMSNorm and RotaryEmbedding do, with fp fusion off: see fused_ops.py,
whose conventions (and argument checks) this kernel shares. CUDA-graph capturable, no host syncs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fused_ops import _check_float, _check_same_device, _num_warps
from nanovllm.kernels.kv_store import FP8_KV_DTYPE, _quantize_e4m3, check_kv_scales, check_paged_cache


@triton.jit
def _norm_rope_heads(
    src_ptr,
    w_ptr,
    dst_ptr,
    first_head,
    num_heads,
    cos,
    sin,
    eps,
    cache_ptr,
    scale_ptr,
    slot,
    row_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    NORM: tl.constexpr,
    STORE: tl.constexpr,
    FP8: tl.constexpr,
    ROW_SCALE: tl.constexpr,
):
    """(RMSNorm +) NeoX rotary of heads [first_head, first_head + BLOCK_HEADS) of one token.

    src/dst point at the token's first head ([num_heads, HEAD_DIM], contiguous); heads past
    num_heads are masked. cos/sin: fp32 [HEAD_DIM // 2] for the token's position. Each head
    is held as its two halves x1 | x2 ([BLOCK_HEADS, HEAD_DIM // 2] each) so the rotation
    needs no shuffles. NORM=False skips the norm (w_ptr and eps unused): rotary only.
    STORE: the rotated heads also go to the paged cache row of `slot` (cache_ptr: the cache's
    first slot, rows of num_heads * HEAD_DIM), skipped when slot < 0; with FP8, quantized by
    the scale at scale_ptr exactly as _store_kvcache_kernel does (so the bytes are the same).
    ROW_SCALE: the heads are first multiplied by the token's `row_scale` (rounded to the dtype).
    """
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = dst_ptr.dtype.element_ty
    heads = first_head + tl.arange(0, BLOCK_HEADS)
    d = tl.arange(0, HALF)
    offs = heads[:, None] * HEAD_DIM + d[None, :]
    mask = (heads[:, None] < num_heads) & (d[None, :] < HALF)
    n1 = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    n2 = tl.load(src_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    if ROW_SCALE:
        n1 = (n1 * row_scale).to(dtype).to(tl.float32)
        n2 = (n2 * row_scale).to(dtype).to(tl.float32)
    if NORM:
        var = (tl.sum(n1 * n1, axis=1) + tl.sum(n2 * n2, axis=1)) / HEAD_DIM
        rstd = tl.rsqrt(var + eps)[:, None]
        w1 = tl.load(w_ptr + d).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + d).to(tl.float32)[None, :]
        # Same roundings as RMSNorm (normed -> dtype, times weight -> dtype), then apply_rotary,
        # which starts from that dtype tensor and rounds once at the end.
        n1 = ((n1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        n2 = ((n2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    o1 = (n1 * c - n2 * s).to(dtype)
    o2 = (n2 * c + n1 * s).to(dtype)
    tl.store(dst_ptr + offs, o1, mask=mask)
    tl.store(dst_ptr + offs + HALF, o2, mask=mask)
    if STORE:
        _store_heads(cache_ptr, scale_ptr, slot, num_heads * HEAD_DIM, offs, o1, o2, mask, HALF, FP8)


@triton.jit
def _store_heads(cache_ptr, scale_ptr, slot, row, offs, x1, x2, mask, HALF: tl.constexpr, FP8: tl.constexpr):
    """Write the halves x1 | x2 (at offs, offs + HALF of a cache row of `row` elements) into
    cache slot `slot` (none when slot < 0), FP8-quantized by *scale_ptr when FP8."""
    # (x1 / x2 are never reassigned here: under the runtime `if`, Triton refuses a variable whose
    # type changes, as bf16 -> fp32 through the quantizer would.)
    if slot >= 0:
        dst = cache_ptr + slot * row + offs
        if FP8:
            scale = tl.load(scale_ptr)
            tl.store(dst, _quantize_e4m3(x1, scale).to(cache_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + HALF, _quantize_e4m3(x2, scale).to(cache_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(dst, x1.to(cache_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + HALF, x2.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr,
    qkv_stride,
    q_w_ptr,
    k_w_ptr,
    cos_sin_ptr,
    cos_sin_stride,
    pos_ptr,
    q_ptr,
    k_ptr,
    eps,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    row_scale_ptr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    NUM_Q_BLOCKS: tl.constexpr,
    NUM_K_BLOCKS: tl.constexpr,
    NORM: tl.constexpr,
    STORE: tl.constexpr,
    FP8: tl.constexpr,
    ROW_SCALE: tl.constexpr,
):
    """q/k RMSNorm (if NORM) + NeoX rotary for one token and one block of BLOCK_HEADS q or k heads.

    Grid (tokens, NUM_Q_BLOCKS + NUM_K_BLOCKS (+ NUM_K_BLOCKS with STORE)): blocks below
    NUM_Q_BLOCKS take q heads, the next NUM_K_BLOCKS k heads, so q and k programs are equally
    sized. qkv rows start at token * qkv_stride and hold q | k | v heads back to back
    (stride(-1) == 1). q: contiguous [tokens, NUM_HEADS, HEAD_DIM], k: contiguous [tokens,
    NUM_KV_HEADS, HEAD_DIM]. cos_sin row `pos` (fp32, stride cos_sin_stride) holds cos | sin,
    HEAD_DIM // 2 each. HEAD_DIM must be a power of two. Positions are not bounds-checked
    (that would need a host sync).

    STORE (the KV-cache store fused in): the k programs also write their rotated heads into
    k_cache at slot slot_ptr[token] (contiguous rows of NUM_KV_HEADS * HEAD_DIM; slot -1
    skips the token), and NUM_K_BLOCKS more programs copy the v heads into v_cache. FP8: the
    caches are float8_e4m3fn, values quantized by *k_scale_ptr / *v_scale_ptr. Saves the
    separate store kernel's launch and its read of k back from memory (v is read once either way).
    ROW_SCALE: every head of the token is first multiplied by row_scale_ptr[token] (fp32; the
    product rounded to qkv's dtype): qkv rows made by an FP8 GEMM with per-row activation
    scales (kernels/fp8_rows.py).
    """
    HALF: tl.constexpr = HEAD_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    slot = -1
    if STORE:
        # int64: slot * row width overflows int32 for caches above 2**31 elements.
        slot = tl.load(slot_ptr + token).to(tl.int64)
    src = qkv_ptr + token * qkv_stride
    row_scale = 1.0
    if ROW_SCALE:
        row_scale = tl.load(row_scale_ptr + token)
    if blk >= NUM_Q_BLOCKS + NUM_K_BLOCKS:  # (STORE only) copy v heads into the cache
        heads = (blk - NUM_Q_BLOCKS - NUM_K_BLOCKS) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
        d = tl.arange(0, HALF)
        offs = heads[:, None] * HEAD_DIM + d[None, :]
        mask = (heads[:, None] < NUM_KV_HEADS) & (d[None, :] < HALF)
        v_src = src + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM
        v1 = tl.load(v_src + offs, mask=mask, other=0.0)
        v2 = tl.load(v_src + offs + HALF, mask=mask, other=0.0)
        if ROW_SCALE:
            v1 = (v1.to(tl.float32) * row_scale).to(v1.dtype)
            v2 = (v2.to(tl.float32) * row_scale).to(v2.dtype)
        _store_heads(v_cache_ptr, v_scale_ptr, slot, NUM_KV_HEADS * HEAD_DIM, offs, v1, v2, mask, HALF, FP8)
    else:
        pos = tl.load(pos_ptr + token).to(tl.int64)
        d = tl.arange(0, HALF)
        cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + d)
        sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + HALF + d)
        if blk < NUM_Q_BLOCKS:
            _norm_rope_heads(src, q_w_ptr, q_ptr + token * (NUM_HEADS * HEAD_DIM), blk * BLOCK_HEADS,
                             NUM_HEADS, cos, sin, eps, k_cache_ptr, k_scale_ptr, slot, row_scale, HEAD_DIM,
                             BLOCK_HEADS, NORM, False, FP8, ROW_SCALE)
        else:
            _norm_rope_heads(src + NUM_HEADS * HEAD_DIM, k_w_ptr, k_ptr + token * (NUM_KV_HEADS * HEAD_DIM),
                             (blk - NUM_Q_BLOCKS) * BLOCK_HEADS, NUM_KV_HEADS, cos, sin, eps, k_cache_ptr,
                             k_scale_ptr, slot, row_scale, HEAD_DIM, BLOCK_HEADS, NORM, STORE, FP8, ROW_SCALE)


def _check_qk_norm_rope(qkv, q_weight, k_weight, cos_sin, positions, num_heads, num_kv_heads, head_dim) -> None:
    """qk_norm_rope's argument checks (see its docstring)."""
    _check_float("qkv", qkv)
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two (e.g. 64 or 128), got {head_dim}")
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(
            f"qkv must be [tokens, {width}] for {num_heads} q / {num_kv_heads} kv heads of "
            f"{head_dim}, got {tuple(qkv.shape)}"
        )
    if qkv.stride(-1) != 1:
        raise ValueError("qkv needs a contiguous last dimension (stride(-1) == 1)")
    norm = q_weight is not None
    if (k_weight is not None) != norm:
        raise ValueError("q_weight and k_weight must both be given (q/k norm) or both be None (rotary only)")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)) if norm else ():
        if w.shape != (head_dim,) or w.dtype != qkv.dtype:
            raise ValueError(f"{name} must be [{head_dim}] {qkv.dtype}, got {tuple(w.shape)} {w.dtype}")
    if cos_sin.dtype != torch.float32 or cos_sin.dim() != 3 or cos_sin.shape[1:] != (1, head_dim):
        raise ValueError(
            f"cos_sin must be float32 [max_position, 1, {head_dim}], got "
            f"{tuple(cos_sin.shape)} {cos_sin.dtype}"
        )
    if cos_sin.stride(-1) != 1:
        raise ValueError("cos_sin needs a contiguous last dimension (stride(-1) == 1)")
    tokens = qkv.shape[0]
    if positions.dim() != 1 or positions.shape[0] != tokens:
        raise ValueError(f"positions must be [{tokens}], got {tuple(positions.shape)}")
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32 or int64, got {positions.dtype}")
    weights = dict(q_weight=q_weight, k_weight=k_weight) if norm else {}
    _check_same_device(qkv=qkv, cos_sin=cos_sin, positions=positions, **weights)



def _check_kv_store(qkv, k_cache, v_cache, slot_mapping, k_scale, v_scale, num_kv_heads, head_dim) -> bool:
    """qk_norm_rope's checks of the fused KV-store arguments (all None: no store); True when
    the cache is FP8."""
    if k_cache is None and v_cache is None:
        if slot_mapping is not None or k_scale is not None or v_scale is not None:
            raise ValueError("slot_mapping / k_scale / v_scale go with k_cache and v_cache")
        return False
    if not (isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)):
        raise ValueError("k_cache and v_cache must both be given (tensors) to store K/V")
    check_paged_cache(k_cache, v_cache)
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"cache heads/head_dim {tuple(k_cache.shape[2:])} do not match ({num_kv_heads}, {head_dim})")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (qkv.dtype, FP8_KV_DTYPE):
        raise ValueError(f"k_cache {k_cache.dtype} / v_cache {v_cache.dtype} must both be qkv's dtype "
                         f"({qkv.dtype}) or float8_e4m3fn")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    tokens = qkv.shape[0]
    if slot_mapping is None or slot_mapping.dim() != 1 or slot_mapping.shape[0] != tokens:
        got = None if slot_mapping is None else tuple(slot_mapping.shape)
        raise ValueError(f"slot_mapping must be [{tokens}] with the caches, got {got}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    fp8 = check_kv_scales(k_cache, k_scale, v_scale)
    _check_same_device(qkv=qkv, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    return fp8


def _check_row_scale(qkv, row_scale, store: bool) -> None:
    if row_scale is not None and (not store or row_scale.dtype != torch.float32
                                  or row_scale.shape != (qkv.shape[0],) or not row_scale.is_contiguous()):
        raise ValueError(f"row_scale must be float32 [{qkv.shape[0]}] and comes with the KV store, got "
                         f"{row_scale.dtype} {tuple(row_scale.shape)}{'' if store else ' without k_cache'}")


def qk_norm_rope(
    qkv: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    *,
    k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None, row_scale: torch.Tensor | None = None):
    """Per-head q/k RMSNorm then NeoX rotary, from the packed qkv projection: (q, k, v).

    qkv: [tokens, (num_heads + 2 * num_kv_heads) * head_dim] float16/bfloat16/float32,
    stride(-1) == 1 (any row stride). q_weight / k_weight: [head_dim], qkv's dtype; both None
    for rotary only (models without q/k norm; eps is then unused).
    cos_sin: fp32 [max_position, 1, head_dim], cos | sin halves (RotaryEmbedding.cos_sin).
    positions: int32/int64 [tokens], each < max_position (not checked: no host syncs).
    head_dim: a power of two. Returns q [tokens, num_heads, head_dim] and k [tokens,
    num_kv_heads, head_dim] as new contiguous tensors, and v [tokens, num_kv_heads, head_dim]
    as a view into qkv (no copy). Same result as RMSNorm on each head followed by
    RotaryEmbedding (or RotaryEmbedding alone), rounding included.

    With k_cache / v_cache (contiguous [num_blocks, block_size, num_kv_heads, head_dim], qkv's
    dtype or float8_e4m3fn) and slot_mapping (int32/int64 [tokens], -1 skips a token), the
    same launch also stores the rotated k and v into the paged caches, bitwise what
    store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) writes (an FP8
    cache needs the fp32 [1] k_scale / v_scale). Slots are not bounds-checked.
    row_scale (fp32 [tokens], with the store only: v stays qkv's unscaled view): each token's heads
    first times it, rounded to qkv's dtype (FP8 rows: kernels/fp8_rows.py).
    """
    _check_qk_norm_rope(qkv, q_weight, k_weight, cos_sin, positions, num_heads, num_kv_heads, head_dim)
    fp8 = _check_kv_store(qkv, k_cache, v_cache, slot_mapping, k_scale, v_scale, num_kv_heads, head_dim)
    store = k_cache is not None or v_cache is not None
    _check_row_scale(qkv, row_scale, store)
    norm, tokens = q_weight is not None, qkv.shape[0]
    q = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((tokens, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(tokens, num_kv_heads, head_dim)
    if tokens > 0:
        # ~1024 elements a program, but no more heads than kv heads: with GQA num_heads is a
        # multiple of num_kv_heads, so no block is half masked.
        block_heads = min(triton.next_power_of_2(num_kv_heads), max(1, 1024 // head_dim))
        num_q_blocks = triton.cdiv(num_heads, block_heads)
        num_k_blocks = triton.cdiv(num_kv_heads, block_heads)
        unused = qkv  # placeholder pointer for arguments a variant does not read
        _qk_norm_rope_kernel[(tokens, num_q_blocks + num_k_blocks * (2 if store else 1))](
            qkv, qkv.stride(0), q_weight.contiguous() if norm else unused,
            k_weight.contiguous() if norm else unused, cos_sin, cos_sin.stride(0), positions.contiguous(), q, k,
            float(eps), k_cache if store else unused, v_cache if store else unused,
            slot_mapping.contiguous() if store else unused, k_scale if fp8 else unused, v_scale if fp8 else unused,
            row_scale if row_scale is not None else unused, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim, BLOCK_HEADS=block_heads, NUM_Q_BLOCKS=num_q_blocks, NUM_K_BLOCKS=num_k_blocks,
            NORM=norm, STORE=store, FP8=fp8, ROW_SCALE=row_scale is not None,
            num_warps=_num_warps(block_heads * head_dim, max_warps=8), enable_fp_fusion=False,
        )
    return q, k, v
