"""Scatter freshly projected keys/values into the paged KV cache (quantizing to FP8 when the
cache is float8_e4m3fn)."""

import torch
import triton
import triton.language as tl

FP8_KV_DTYPE = torch.float8_e4m3fn


@triton.jit
def _quantize_e4m3(x, scale):
    """clamp(x / scale, -448, 448) rounded to nearest even on the e4m3 grid, still in fp32.

    The rounding is done here, so the cast to fp8 that follows is exact: Triton's interpreter
    rounds fp32 -> fp8 casts wrongly (ties away from zero, and a round-up that should carry
    into the exponent wraps instead), and this keeps the kernel bitwise equal to torch's
    cast on the interpreter and the GPU alike. It costs a few ALU ops per element in a
    memory-bound kernel. Trick: adding 2**(e + 20) to |y| in [2**e, 2**(e + 1)) puts the
    fp32 ulp at 2**(e - 3), the e4m3 spacing there, so the (RNE) addition rounds |y| to the
    e4m3 grid and the subtraction is exact; e4m3 subnormals share the spacing of 2**-6.
    """
    # NaN stays NaN, as in torch (a bare clamp may turn it into +-448 on the GPU).
    y = tl.clamp(tl.div_rn(x.to(tl.float32), scale), -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    bits = y.to(tl.uint32, bitcast=True)
    biased_exp = tl.maximum((bits >> 23) & 0xFF, 127 - 6)
    magic = ((biased_exp + 20) << 23).to(tl.float32, bitcast=True)
    rounded = (tl.abs(y) + magic) - magic
    # Copy y's sign bit (not a comparison) so that -0 and negatives rounding to 0 give -0, as torch does.
    return (rounded.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)


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
    k_scale_ptr,
    v_scale_ptr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8: tl.constexpr,
):
    """Copy one token's [NUM_KV_HEADS, HEAD_DIM] key and value rows into cache slot `slot`.

    One program per token. The cache row of a slot is contiguous (NUM_KV_HEADS * HEAD_DIM
    elements), so the write is one contiguous vector; the read follows the source strides.
    BLOCK is NUM_KV_HEADS * HEAD_DIM rounded up to a power of two (tl.arange needs one).
    FP8: the caches are float8_e4m3fn; each value is stored as
    clamp(x / scale, -448, 448) rounded to nearest even, with fp32 x and the correctly rounded
    division (div_rn) that torch's `x.float() / scale` also does, so the bytes match torch's.
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
        if FP8:
            k = _quantize_e4m3(k, tl.load(k_scale_ptr)).to(k_cache_ptr.dtype.element_ty)
            v = _quantize_e4m3(v, tl.load(v_scale_ptr)).to(v_cache_ptr.dtype.element_ty)
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


def check_kv_scales(
    cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> bool:
    """Validate the per-tensor K/V scales that go with `cache`; True when the cache is FP8.

    An FP8 (float8_e4m3fn) cache needs both scales as fp32 [1] tensors on the cache's device
    (read by pointer in the kernels, so they may change after a CUDA graph was captured);
    any other cache takes none. Anything else is a ValueError.
    """
    fp8 = cache.dtype == FP8_KV_DTYPE
    if not fp8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale apply only to an FP8 KV cache, this one is {cache.dtype}")
        return False
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"an FP8 KV cache needs {name} (an fp32 tensor of shape [1])")
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.shape != (1,):
            got = f"{s.dtype} {tuple(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(f"{name} must be an fp32 tensor of shape [1], got {got}")
        if s.device != cache.device:
            raise ValueError(f"{name} is on {s.device}, the cache on {cache.device}")
    return True


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write key[i] / value[i] into cache slot slot_mapping[i] (in place).

    key, value: [N, num_kv_heads, head_dim] bf16/fp16/fp32; any strides as long as
    stride(-1) == 1 (views into a packed qkv projection are fine). k_cache, v_cache:
    contiguous [num_blocks, block_size, num_kv_heads, head_dim] (flash-attn paged layout),
    on key's device, of key's dtype or float8_e4m3fn. An FP8 cache needs k_scale / v_scale
    (fp32 [1] device tensors, read in the kernel): it stores
    clamp(key.float() / k_scale, -448, 448).to(float8_e4m3fn), likewise for V, bitwise as
    torch computes that expression. slot_mapping: int32 or int64 [N]; slot = block_id * block_size
    + offset, and a slot of -1 skips that token (padding rows of a CUDA graph). Slots are not
    bounds-checked against the cache: that would need a host sync. No host syncs at all, so
    this may be captured in a CUDA graph. N == 0 is a no-op.
    """
    fp8 = _check_store_inputs(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    n, num_kv_heads, head_dim = key.shape
    if n == 0:
        return
    # The kernel indexes slot_mapping with a unit stride.
    slot_mapping = slot_mapping.contiguous()
    width = num_kv_heads * head_dim
    _store_kvcache_kernel[(n,)](
        key, key.stride(0), key.stride(1), value, value.stride(0), value.stride(1), k_cache, v_cache, slot_mapping,
        k_scale if fp8 else slot_mapping,  # unused without FP8
        v_scale if fp8 else slot_mapping, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK=triton.next_power_of_2(width), FP8=fp8, num_warps=4 if width >= 512 else 1,
    )


def _check_store_inputs(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> bool:
    """store_kvcache's argument checks (see its docstring); whether the cache is FP8."""
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
    if key.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"key/value must be bf16, fp16 or fp32, got {key.dtype}")
    if not (key.dtype == value.dtype and k_cache.dtype == v_cache.dtype
            and k_cache.dtype in (key.dtype, FP8_KV_DTYPE)):
        raise ValueError(
            f"dtypes differ: key {key.dtype}, value {value.dtype}, k_cache {k_cache.dtype}, "
            f"v_cache {v_cache.dtype} (the caches take key's dtype or float8_e4m3fn)"
        )
    fp8 = check_kv_scales(k_cache, k_scale, v_scale)
    devices = {key.device, value.device, k_cache.device, v_cache.device, slot_mapping.device}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value need a contiguous last dimension (stride(-1) == 1)")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    return fp8
