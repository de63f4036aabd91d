"""Scatter freshly projected keys/values into the paged KV cache."""

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    key_stride_n,
    key_stride_h,
    value_ptr,
    value_stride_n,
    value_stride_h,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Copy one token's [NUM_KV_HEADS, HEAD_DIM] key and value rows into cache slot `slot`.

    One program per token. The cache row of a slot is contiguous (NUM_KV_HEADS * HEAD_DIM
    elements), so the write is one contiguous vector; the read follows the source strides.
    BLOCK is NUM_KV_HEADS * HEAD_DIM rounded up to a power of two (tl.arange needs one).
    """
    token = tl.program_id(0).to(tl.int64)
    # int64: slot * row width overflows int32 for caches above 2**31 elements.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < NUM_KV_HEADS * HEAD_DIM
        head = offs // HEAD_DIM
        dim = offs % HEAD_DIM
        k = tl.load(key_ptr + token * key_stride_n + head * key_stride_h + dim, mask=mask)
        v = tl.load(value_ptr + token * value_stride_n + head * value_stride_h + dim, mask=mask)
        dst = slot * (NUM_KV_HEADS * HEAD_DIM) + offs
        tl.store(k_cache_ptr + dst, k, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)


def check_paged_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Raise ValueError unless both caches are [num_blocks, block_size, num_kv_heads, head_dim]."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key[i] / value[i] into cache slot slot_mapping[i] (in place).

    key, value: [N, num_kv_heads, head_dim]; any strides as long as stride(-1) == 1 (views
    into a packed qkv projection are fine). k_cache, v_cache: contiguous
    [num_blocks, block_size, num_kv_heads, head_dim] (flash-attn paged layout), same dtype
    and device as key/value. slot_mapping: int32 or int64 [N]; slot = block_id * block_size
    + offset, and a slot of -1 skips that token (padding rows of a CUDA graph). Slots are not
    bounds-checked against the cache: that would need a host sync. No host syncs at all, so
    this may be captured in a CUDA graph. N == 0 is a no-op.
    """
    if key.dim() != 3 or value.dim() != 3:
        raise ValueError(
            f"key and value must be [N, num_kv_heads, head_dim], got {tuple(key.shape)} "
            f"and {tuple(value.shape)}"
        )
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ in shape")
    check_paged_cache(k_cache, v_cache)
    n, num_kv_heads, head_dim = key.shape
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"cache heads/head_dim {tuple(k_cache.shape[2:])} do not match key "
            f"({num_kv_heads}, {head_dim})"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != n:
        raise ValueError(f"slot_mapping must be [{n}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if not (key.dtype == value.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(
            f"dtypes differ: key {key.dtype}, value {value.dtype}, k_cache {k_cache.dtype}, "
            f"v_cache {v_cache.dtype}"
        )
    devices = {key.device, value.device, k_cache.device, v_cache.device, slot_mapping.device}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value need a contiguous last dimension (stride(-1) == 1)")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if n == 0:
        return
    # The kernel indexes slot_mapping with a unit stride.
    slot_mapping = slot_mapping.contiguous()
    width = num_kv_heads * head_dim
    _store_kvcache_kernel[(n,)](
        key,
        key.stride(0),
        key.stride(1),
        value,
        value.stride(0),
        value.stride(1),
        k_cache,
        v_cache,
        slot_mapping,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK=triton.next_power_of_2(width),
        num_warps=4 if width >= 512 else 1,
    )
