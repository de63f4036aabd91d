"""Split-KV (flash-decoding) attention for one decode token per sequence over a paged KV cache
(bf16/fp16/fp32, or FP8 e4m3 with per-tensor K/V scales)."""

import math

import torch
import triton
import triton.language as tl

from nanovllm.kernels.kv_store import FP8_KV_DTYPE, check_kv_scales, check_paged_cache

_LOG2E = 1.4426950408889634


# A mixed step passes the rows after its prefill ones (TritonBackend._mixed): their tables and
# lengths start anywhere, and a variant per alignment would compile inside a run. Both are read a
# value at a time: the sm90 SASS is the same with or without the alignment hint.
@triton.jit(do_not_specialize_on_alignment=["block_tables_ptr", "context_lens_ptr"])
def _paged_decode_split_kernel(
    q_ptr,
    q_stride_b,
    q_stride_h,
    k_cache_ptr,
    v_cache_ptr,
    cache_stride_block,
    cache_stride_token,
    block_tables_ptr,
    block_tables_stride_b,
    context_lens_ptr,
    context_lens_stride,
    out_ptr,
    out_stride_b,
    out_stride_h,
    part_out_ptr,
    part_lse_ptr,
    k_scale_ptr,
    v_scale_ptr,
    qk_scale,
    max_blocks_per_seq,
    num_splits,
    NUM_HEADS: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP16_DOT: tl.constexpr,
):
    """Attention of the GROUP query heads sharing kv head `kvh` over one split of one sequence.

    Grid (num_kv_heads * num_splits, B): program (kvh * num_splits + split, b). GPUs start
    programs in about grid order (observed, not promised by CUDA), so a sequence's programs
    start together and sequences start in row order; rows ordered longest context first (the
    scheduler's decode order) keep the longest work from starting last (what that is worth:
    benchmarks/kernels/bench_decode_order.py, BENCHMARKS.md).

    The sequence's own context (not the table's width) is cut into num_splits runs of whole
    TILEs, as even as TILE allows; split s takes run s (empty when the context has fewer tiles
    than splits), walked TILE tokens at a time with an fp32 online softmax kept in the log2
    domain (qk_scale already includes log2(e)).

    WRITE_PARTIAL False (one split): writes the normalised result straight into out (q's
    dtype). True: writes the normalised partial output to part_out [B, NUM_HEADS,
    num_splits, HEAD_DIM] (fp32) and its log2-sum-exp to part_lse [B, NUM_HEADS,
    num_splits]; an empty split writes 0 and -inf so that it carries no weight in the merge.

    KV_FP8: the caches hold float8_e4m3fn, true value = stored * scale. Tiles are converted in
    registers (exact: e4m3 values are all representable in fp16/bf16/fp32), the K scale is
    folded into the score scale and the V scale into the normalised output (attention is
    linear in V), so the loop costs nothing beyond the conversions. Scales are read from
    device pointers: they may be set after a CUDA graph was captured. FP16_DOT (FP8 cache, 16-
    bit q): q is pre-scaled and rounded to fp16 and both dots run in fp16 (the probabilities
    too), fp32 accumulation.
    """
    kvh = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    b = tl.program_id(1)

    ctx = tl.load(context_lens_ptr + b * context_lens_stride)
    # Never walk past the block table, whatever context_lens says.
    ctx = tl.minimum(ctx, max_blocks_per_seq * BLOCK_SIZE)
    # Splitting each sequence's own length keeps every split busy whatever the table's width:
    # CUDA graphs are captured with tables as wide as max_model_len, mostly longer than the
    # contexts, and splits of that width would leave the tail splits idle.
    tiles_per_split = tl.cdiv(tl.cdiv(ctx, TILE), num_splits)
    start = split * tiles_per_split * TILE
    end = tl.minimum(start + tiles_per_split * TILE, ctx)

    rows = tl.arange(0, GROUP_PAD)
    row_mask = rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + rows
    # Rows past GROUP load as zeros: they only exist to give tl.dot its 16-row minimum.
    q = tl.load(
        q_ptr + b * q_stride_b + heads[:, None] * q_stride_h + dims[None, :],
        mask=row_mask[:, None],
        other=0.0,
    )

    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    if FP16_DOT:
        # The score scale goes into q once, in fp32, and the dots run in fp16: e4m3 widens to
        # fp16 in one instruction per pair, where bf16 costs a detour through fp32 that made
        # the conversions, not the halved bytes, bound the kernel (BENCHMARKS.md, FP8 KV).
        q = (q.to(tl.float32) * qk_scale).to(tl.float16)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)

    bt_row = block_tables_ptr + b.to(tl.int64) * block_tables_stride_b
    kv_col = kvh * HEAD_DIM + dims
    toks = tl.arange(0, TILE)
    for tile_start in range(start, end, TILE):
        tok = tile_start + toks
        tok_mask = tok < end
        if BLOCK_SIZE >= TILE:
            # The tile lies inside one block: one block-table read, contiguous token rows.
            phys = tl.load(bt_row + tile_start // BLOCK_SIZE).to(tl.int64)
            in_block = tile_start % BLOCK_SIZE + toks
            row_off = phys * cache_stride_block + in_block * cache_stride_token
        else:
            # The tile spans several small blocks: gather one block id per token. Masked
            # tokens never touch the table, whose tail may hold garbage.
            phys = tl.load(bt_row + tok // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
            row_off = phys * cache_stride_block + (tok % BLOCK_SIZE) * cache_stride_token
        kv_off = row_off[:, None] + kv_col[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=tok_mask[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=tok_mask[:, None], other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if not FP16_DOT:
            s = s * qk_scale
        s = tl.where(tok_mask[None, :], s, float("-inf"))
        # The first tile of a split always holds a valid token, so m_new is finite and
        # exp2 never sees (-inf) - (-inf).
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    nonempty = l_i > 0.0
    o = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    if KV_FP8:
        o = o * tl.load(v_scale_ptr)
    if not WRITE_PARTIAL:
        out_off = b * out_stride_b + heads[:, None] * out_stride_h + dims[None, :]
        tl.store(out_ptr + out_off, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        part_row = (b * NUM_HEADS + heads) * num_splits + split
        tl.store(
            part_out_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], o, mask=row_mask[:, None]
        )
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part_row, lse, mask=row_mask)


@triton.jit
def _paged_decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    out_stride_b,
    out_stride_h,
    num_splits,
    NUM_HEADS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Combine the num_splits partial results of one (sequence, head) into out.

    Grid (B, NUM_HEADS). Each split is weighted by 2**(lse_s - max lse); splits with
    lse = -inf weigh 0, and a row whose splits are all empty (context length 0) gets zeros.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_mask = splits < num_splits
    dims = tl.arange(0, HEAD_DIM)
    row = (b * NUM_HEADS + h) * num_splits
    lse = tl.load(part_lse_ptr + row + splits, mask=split_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    # All splits empty: shift by 0 instead of -inf so every weight is exactly 0, not NaN.
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, axis=0)
    part = tl.load(
        part_out_ptr + (row + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None],
        other=0.0,
    )
    o = tl.sum(part * w[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + b * out_stride_b + h * out_stride_h + dims, o.to(out_ptr.dtype.element_ty))


def choose_num_splits(
    batch_size: int, num_kv_heads: int, max_blocks_per_seq: int, num_sms: int = 132
) -> int:
    """Number of KV splits for paged_decode_attention.

    Aims for about ten split-kernel programs per SM (so about 1,300 on an H200): many
    programs per SM keep enough loads in flight to saturate HBM and smooth out uneven context
    lengths; beyond that they only add merge traffic (benchmarks/kernels/bench_paged_decode.py
    sweeps the split counts; BENCHMARKS.md has how close the rule comes to the best ones).
    Never more than max_blocks_per_seq: the table's width bounds the longest
    context, and splits of less than a block's worth of tokens would not pay for their merge.
    """
    for name, value in (
        ("batch_size", batch_size),
        ("num_kv_heads", num_kv_heads),
        ("max_blocks_per_seq", max_blocks_per_seq),
        ("num_sms", num_sms),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return min(max_blocks_per_seq, triton.cdiv(10 * num_sms, batch_size * num_kv_heads))


def _launch_config(head_dim: int, elem_size: int, fp8: bool = False) -> tuple[int, int, int]:
    """(TILE, num_warps, num_stages) for the split kernel; elem_size is q's, fp8 the cache's."""
    # 64 tokens x 128 dims of bf16 per K or V tile (16 KiB each): on an H200 this was at the
    # top of a sweep over tiles 32-128, 2-8 warps and 1-3 stages; bigger tiles add registers
    # without adding bandwidth. Keep those bytes per tile for other element sizes and head
    # sizes. An FP8 cache keeps q's tile: on the H200, 128-token FP8 tiles were no faster
    # (benchmarks/kernels/bench_decode_fp8_config.py; BENCHMARKS.md).
    tile = max(16, min(128, 64 * 2 * 128 // (elem_size * head_dim)))
    if fp8:
        # Half the bytes a tile: two warps a program (twice the programs an SM holds) and three
        # stages keep more tiles in flight; 8-10% faster than (4, 2) at the bench's decode
        # shapes on an H100 (bench_decode_fp8_config.py, BENCHMARKS.md).
        return tile, 2, 3
    return tile, 4, 2


def _check_decode_inputs(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, out, k_scale,
                         v_scale) -> tuple[torch.Tensor, bool]:
    """paged_decode_attention's argument checks (see its docstring); (out, whether the cache is
    FP8), out allocated when None."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, num_heads, head_dim], got {tuple(q.shape)}")
    check_paged_cache(k_cache, v_cache)
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"cache head_dim {cache_head_dim} != q head_dim {head_dim}")
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {head_dim}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [{batch}, max_blocks_per_seq], got {tuple(block_tables.shape)}")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise ValueError(f"block_tables and context_lens must be int32, got {block_tables.dtype} and "
                         f"{context_lens.dtype}")
    if batch > 65535:  # the grid's second dimension
        raise ValueError(f"at most 65535 sequences per call, got {batch}")
    if context_lens.shape != (batch,):
        raise ValueError(f"context_lens must be [{batch}], got {tuple(context_lens.shape)}")
    if not (k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, FP8_KV_DTYPE)):
        raise ValueError(
            f"dtypes differ: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype} "
            f"(the caches take q's dtype or float8_e4m3fn)"
        )
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {q.dtype}")
    fp8 = check_kv_scales(k_cache, k_scale, v_scale)
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, context_lens)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if q.stride(-1) != 1:
        raise ValueError("q needs a contiguous last dimension (stride(-1) == 1)")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if block_tables.stride(1) != 1 and block_tables.shape[1] > 1:
        raise ValueError("block_tables needs a contiguous last dimension")
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, got {tuple(out.shape)} "
            f"{out.dtype} on {out.device}"
        )
    elif out.stride(-1) != 1:
        raise ValueError("out needs a contiguous last dimension (stride(-1) == 1)")
    return out, fp8


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention for one query token per sequence over a paged KV cache.

    out[b, h] = softmax(q[b, h] K_b^T * scale) V_b, K_b/V_b the sequence's cached tokens.

    q: [B, num_heads, head_dim] (stride(-1) == 1). k_cache, v_cache: contiguous
    [num_blocks, block_size, num_kv_heads, head_dim], block_size a power of two >= 16,
    head_dim a power of two in [16, 256]. num_heads = group * num_kv_heads (GQA; query head h
    reads kv head h // group). block_tables: int32 [B, max_blocks_per_seq]; entries past
    cdiv(context_len, block_size) are never read. context_lens: int32 [B], the number of
    cached tokens (the decode token included, hence no causal mask); a length of 0 gives a
    zero output row. num_splits: KV splits per sequence (see choose_num_splits), each
    taking an even share of the sequence's own context in whole TILEs; rows sorted longest
    context first run fastest (see the split kernel). The launch grid depends only on shapes
    and num_splits, and nothing syncs with the host, so the call can be captured in a CUDA
    graph (call it once eagerly first so the kernels are compiled).
    out: optional [B, num_heads, head_dim] buffer of q's
    dtype (stride(-1) == 1). Returns out.
    FP8 KV cache: k_cache / v_cache float8_e4m3fn holding K / k_scale and V / v_scale
    (store_kvcache's quantization); k_scale, v_scale: fp32 [1] device tensors, required
    then and only then. The result is attention over stored.float() * scale.
    """
    out, fp8 = _check_decode_inputs(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, out,
                                    k_scale, v_scale)
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if batch == 0:
        return out

    max_blocks = block_tables.shape[1]
    group = num_heads // num_kv_heads
    tile, num_warps, num_stages = _launch_config(head_dim, q.element_size(), fp8)
    # Splits beyond the table's capacity in tiles could never get tokens.
    num_splits = max(1, min(num_splits, triton.cdiv(max_blocks * block_size, tile)))
    part_out, part_lse = _partials(out, num_splits)
    _paged_decode_split_kernel[(num_kv_heads * num_splits, batch)](
        q, q.stride(0), q.stride(1), k_cache, v_cache, k_cache.stride(0), k_cache.stride(1),
        block_tables, block_tables.stride(0), context_lens, context_lens.stride(0),
        out, out.stride(0), out.stride(1), part_out, part_lse,
        k_scale if fp8 else out, v_scale if fp8 else out,  # unused without FP8
        float(scale) * _LOG2E, max_blocks, num_splits,
        NUM_HEADS=num_heads, WRITE_PARTIAL=num_splits > 1, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size, TILE=tile,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_FP8=fp8,
        FP16_DOT=fp8 and q.dtype != torch.float32, num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _merge_partials(part_out, part_lse, out, num_splits)
    return out


def _partials(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernel's fp32 partial outputs [B, heads, splits, head_dim] and log-sum-exps
    [B, heads, splits]; with one split it writes `out` directly (the two are then unused)."""
    if num_splits == 1:
        return out, out
    batch, num_heads, head_dim = out.shape
    return (torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=out.device),
            torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=out.device))


def _merge_partials(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, num_splits: int) -> None:
    batch, num_heads, head_dim = out.shape
    _paged_decode_merge_kernel[(batch, num_heads)](
        part_out, part_lse, out, out.stride(0), out.stride(1), num_splits,
        NUM_HEADS=num_heads, SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
        num_warps=4 if num_splits * head_dim >= 2048 else 2,
    )
