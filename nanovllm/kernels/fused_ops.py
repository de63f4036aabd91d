"""Fused elementwise ops of a decoder layer: one Triton kernel per op instead of ~20 tiny torch ops.

- `rms_norm`: RMSNorm, optionally fused with the residual add before it.
- `qk_norm_rope`: per-head q/k RMSNorm (optional: models without q/k norm) + NeoX rotary,
  straight from the packed qkv projection; optionally storing k and v into the paged KV cache
  in the same launch (kernels/kv_store.py's store, bitwise, FP8 cache included).
- `silu_and_mul`: silu(gate) * up of the packed gate_up projection.

Math is fp32, but every intermediate that the plain-torch layers in nanovllm/layers round to the
activation dtype is rounded here too, at the same place, so results match those references
(bit-for-bit up to ulp-level differences of rsqrt/exp and of the reduction order). Kernels are
compiled with fp fusion (FMA contraction) off: torch runs each product and sum as a separate
kernel, so it rounds after each of them, and contracting them would shift the rounding.

The wrappers allocate their outputs, validate shapes/dtypes on the host only (no host syncs), and
are CUDA-graph capturable. The layers call them for CUDA tensors only; on CPU the engine keeps
the torch ops, and the kernels run there only through Triton's interpreter, for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.kv_store import FP8_KV_DTYPE, _quantize_e4m3, check_kv_scales, check_paged_cache

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Above this one row no longer fits in registers of one program (spills, then failures).
_MAX_HIDDEN = 32768


def _num_warps(elements: int, per_thread: int = 8, max_warps: int = 16) -> int:
    # ~8 elements a thread: 16-byte vector accesses in bf16, and enough warps to hide latency
    # when only a few hundred rows (decode) are in flight.
    return max(1, min(max_warps, triton.next_power_of_2(elements) // (32 * per_thread)))


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")


def _check_same_device(**tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"{', '.join(tensors)} must be on one device, got {sorted(map(str, devices))}")


# ----------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    x_stride,
    add_ptr,
    add_stride,
    res_ptr,
    res_stride,
    w_ptr,
    y_ptr,
    res_out_ptr,
    n_cols,
    eps,
    HAS_ADDEND: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """y[r] = weight * (s * rsqrt(mean(s^2) + eps)) for one row r, with s = x[r] (+ residual[r]).

    One program per row. x / residual rows start at r * stride (last dim contiguous); y and
    res_out are contiguous [rows, n_cols]. BLOCK = next_power_of_2(n_cols), lanes past n_cols
    masked (they load 0, which leaves the sum of squares alone). With HAS_RESIDUAL, s is rounded
    to the dtype (torch adds in the activation dtype) and stored to res_out. The normed row is
    rounded to the dtype before the weight product, and the product is rounded again, as
    transformers' Qwen3RMSNorm does (`weight * normed.to(dtype)`). With HAS_ADDEND, x[r] is first
    replaced by (x[r] + addend[r]) rounded to the dtype (a peer's partial sum: what a two-rank
    all-reduce would have produced).
    """
    row = tl.program_id(0).to(tl.int64)
    dtype = y_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_ADDEND:
        a = tl.load(add_ptr + row * add_stride + offs, mask=mask, other=0.0).to(tl.float32)
        x = (x + a).to(dtype).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(dtype)
        tl.store(res_out_ptr + row * n_cols + offs, s, mask=mask)
        x = s.to(tl.float32)
    tl.store(y_ptr + row * n_cols + offs, _rms_norm_row(x, w_ptr, offs, mask, n_cols, eps, dtype), mask=mask)


@triton.jit
def _rms_norm_row(x, w_ptr, offs, mask, n_cols, eps, dtype: tl.constexpr):
    """weight * (x * rsqrt(mean(x^2) + eps)) of one fp32 row (masked lanes 0), rounded as
    transformers does: the normed row to `dtype`, then the product with the weight."""
    var = tl.sum(x * x, axis=0) / n_cols
    normed = (x * tl.rsqrt(var + eps)).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # Both factors are exact in fp32 and their product fits in its mantissa (bf16/fp16), so
    # rounding it once to the dtype equals torch's low-precision multiply.
    return (normed * w).to(dtype)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    addend: torch.Tensor | None = None,
):
    """RMSNorm over the last dim of x: `y` or, with `residual`, `(y, x + residual)`.

    x: [..., hidden] float16/bfloat16/float32 with stride(-1) == 1 (2-D row views with any
    row stride are used as is; other layouts are flattened with reshape). weight: [hidden],
    same dtype. residual: same shape and dtype as x. Without residual y = norm(x); with it
    s = (x + residual) rounded to the dtype and the result is (norm(s), s). Outputs are new
    contiguous tensors of x's shape and dtype. hidden <= 32768. `addend` (like residual): x is
    replaced by (x + addend) rounded to the dtype first, e.g. to finish a two-rank all-reduce.
    """
    _check_float("x", x)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must be [..., hidden] with hidden > 0, got {tuple(x.shape)}")
    hidden = x.shape[-1]
    if hidden > _MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} exceeds the supported {_MAX_HIDDEN}")
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    if x.stride(-1) != 1:
        raise ValueError("x needs a contiguous last dimension (stride(-1) == 1)")
    tensors = {"x": x, "weight": weight}
    for name, t in (("residual", residual), ("addend", addend)):
        if t is None:
            continue
        if t.shape != x.shape or t.dtype != x.dtype:
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} must match x {tuple(x.shape)} {x.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension (stride(-1) == 1)")
        tensors[name] = t
    _check_same_device(**tensors)

    x2 = x.reshape(-1, hidden)
    rows = x2.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(y) if residual is not None else None
    if rows > 0:
        weight = weight.contiguous()
        r2 = residual.reshape(-1, hidden) if residual is not None else x2
        a2 = addend.reshape(-1, hidden) if addend is not None else x2
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x2,
            x2.stride(0),
            a2,
            a2.stride(0),
            r2,
            r2.stride(0),
            weight,
            y,
            res_out if res_out is not None else y,  # unused without a residual
            hidden,
            float(eps),
            HAS_ADDEND=addend is not None,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=_num_warps(block),
            enable_fp_fusion=False,
        )
    return y if residual is None else (y, res_out)


# ----------------------------------------------------------------------------- q/k norm + RoPE


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
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    NORM: tl.constexpr,
    STORE: tl.constexpr,
    FP8: tl.constexpr,
):
    """(RMSNorm +) NeoX rotary of heads [first_head, first_head + BLOCK_HEADS) of one token.

    src/dst point at the token's first head ([num_heads, HEAD_DIM], contiguous); heads past
    num_heads are masked. cos/sin: fp32 [HEAD_DIM // 2] for the token's position. Each head
    is held as its two halves x1 | x2 ([BLOCK_HEADS, HEAD_DIM // 2] each) so the rotation
    needs no shuffles. NORM=False skips the norm (w_ptr and eps unused): rotary only.
    STORE: the rotated heads also go to the paged cache row of `slot` (cache_ptr: the cache's
    first slot, rows of num_heads * HEAD_DIM), skipped when slot < 0; with FP8, quantized by
    the scale at scale_ptr exactly as _store_kvcache_kernel does (so the bytes are the same).
    """
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = dst_ptr.dtype.element_ty
    heads = first_head + tl.arange(0, BLOCK_HEADS)
    d = tl.arange(0, HALF)
    offs = heads[:, None] * HEAD_DIM + d[None, :]
    mask = (heads[:, None] < num_heads) & (d[None, :] < HALF)
    n1 = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    n2 = tl.load(src_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
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
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    NUM_Q_BLOCKS: tl.constexpr,
    NUM_K_BLOCKS: tl.constexpr,
    NORM: tl.constexpr,
    STORE: tl.constexpr,
    FP8: tl.constexpr,
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
    """
    HALF: tl.constexpr = HEAD_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    slot = -1
    if STORE:
        # int64: slot * row width overflows int32 for caches above 2**31 elements.
        slot = tl.load(slot_ptr + token).to(tl.int64)
    src = qkv_ptr + token * qkv_stride
    if blk >= NUM_Q_BLOCKS + NUM_K_BLOCKS:  # (STORE only) copy v heads into the cache
        heads = (blk - NUM_Q_BLOCKS - NUM_K_BLOCKS) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
        d = tl.arange(0, HALF)
        offs = heads[:, None] * HEAD_DIM + d[None, :]
        mask = (heads[:, None] < NUM_KV_HEADS) & (d[None, :] < HALF)
        v_src = src + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM
        v1 = tl.load(v_src + offs, mask=mask, other=0.0)
        v2 = tl.load(v_src + offs + HALF, mask=mask, other=0.0)
        _store_heads(v_cache_ptr, v_scale_ptr, slot, NUM_KV_HEADS * HEAD_DIM, offs, v1, v2, mask, HALF, FP8)
    else:
        pos = tl.load(pos_ptr + token).to(tl.int64)
        d = tl.arange(0, HALF)
        cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + d)
        sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + HALF + d)
        if blk < NUM_Q_BLOCKS:
            _norm_rope_heads(src, q_w_ptr, q_ptr + token * (NUM_HEADS * HEAD_DIM), blk * BLOCK_HEADS,
                             NUM_HEADS, cos, sin, eps, k_cache_ptr, k_scale_ptr, slot, HEAD_DIM, BLOCK_HEADS,
                             NORM, False, FP8)
        else:
            _norm_rope_heads(src + NUM_HEADS * HEAD_DIM, k_w_ptr, k_ptr + token * (NUM_KV_HEADS * HEAD_DIM),
                             (blk - NUM_Q_BLOCKS) * BLOCK_HEADS, NUM_KV_HEADS, cos, sin, eps, k_cache_ptr,
                             k_scale_ptr, slot, HEAD_DIM, BLOCK_HEADS, NORM, STORE, FP8)


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
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
):
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
    """
    _check_qk_norm_rope(qkv, q_weight, k_weight, cos_sin, positions, num_heads, num_kv_heads, head_dim)
    fp8 = _check_kv_store(qkv, k_cache, v_cache, slot_mapping, k_scale, v_scale, num_kv_heads, head_dim)
    store = k_cache is not None or v_cache is not None
    norm = q_weight is not None
    tokens = qkv.shape[0]
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
            qkv,
            qkv.stride(0),
            q_weight.contiguous() if norm else unused,
            k_weight.contiguous() if norm else unused,
            cos_sin,
            cos_sin.stride(0),
            positions.contiguous(),
            q,
            k,
            float(eps),
            k_cache if store else unused,
            v_cache if store else unused,
            slot_mapping.contiguous() if store else unused,
            k_scale if fp8 else unused,
            v_scale if fp8 else unused,
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_HEADS=block_heads,
            NUM_Q_BLOCKS=num_q_blocks,
            NUM_K_BLOCKS=num_k_blocks,
            NORM=norm,
            STORE=store,
            FP8=fp8,
            num_warps=_num_warps(block_heads * head_dim, max_warps=8),
            enable_fp_fusion=False,
        )
    return q, k, v


# ----------------------------------------------------------------------------- SiLU * mul


@triton.jit
def _silu_and_mul_kernel(x_ptr, x_stride, y_ptr, d, BLOCK: tl.constexpr):
    """y[r, c] = silu(x[r, c]) * x[r, d + c] for one row r and BLOCK columns c.

    Grid (rows, cdiv(d, BLOCK)); x rows start at r * x_stride (stride(-1) == 1), y is
    contiguous [rows, d]. silu is computed in fp32 and rounded to the dtype, then the
    product is rounded again: what `F.silu(gate) * up` does in bf16/fp16.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    dtype = y_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    # exp(-gate) overflowing to inf for very negative gate gives gate / inf = -0: correct limit.
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(y_ptr + row * d + cols, (act * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for x [..., 2 * d]: a new contiguous [..., d] tensor.

    x: float16/bfloat16/float32 with stride(-1) == 1 (2-D row views with any row stride are
    used as is; other layouts are flattened with reshape). Rounds as SiluAndMul does.
    """
    _check_float("x", x)
    if x.dim() < 1 or x.shape[-1] == 0 or x.shape[-1] % 2:
        raise ValueError(f"x must be [..., 2 * d] with d > 0, got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError("x needs a contiguous last dimension (stride(-1) == 1)")
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    y = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows > 0:
        block = min(triton.next_power_of_2(d), 1024)
        _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](
            x2,
            x2.stride(0),
            y,
            d,
            BLOCK=block,
            num_warps=_num_warps(block, max_warps=8),
            enable_fp_fusion=False,
        )
    return y
