"""The FP8 KV cache's encoding in plain torch (vLLM's semantics, `kv_cache_dtype="fp8"`):
float8_e4m3fn values, stored = clamp(k / k_scale, -448, 448) and read back as stored.float() *
k_scale (V likewise), with one fp32 K and V scale per layer. The Triton kernels (kernels/kv_store.py,
paged_decode.py) do the same arithmetic; this is their reference and the CPU path. A 16-bit cache
never loads this module (paged_kv.py's fp8_codec, through the loader nanovllm/wiring/ registers)."""

from __future__ import annotations

from typing import Protocol

import torch

from nanovllm.kernels.kv_store import check_kv_scales  # (Triton: loaded for FP8 caches only)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448


class KVScaleCalibrator(Protocol):
    """Writes an FP8 cache's K and V scales (fp32 [1] buffers, in place) from a prefill's own K/V
    (features/quantization/fp8_kv.py): an attention layer's `calibrate_next_prefill`."""

    def __call__(self, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None: ...


def calibrate(attn, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Runs an attention layer's calibrator on this prefill's K/V, then clears it. Returns False,
    the layer's new kv_stored: whatever the caller stored (a piecewise prefill graph's fused
    store) went in with the scales of before, so the layer stores again with the calibrated ones."""
    with torch.no_grad():
        attn.calibrate_next_prefill(k, v, attn.k_scale, attn.v_scale)
    attn.calibrate_next_prefill = None
    return False


def fp8_kv(k_cache: torch.Tensor, k_scale, v_scale) -> bool:
    """True for an FP8 cache; checks that the scales come with it and only with it (the
    kernels' check, kernels/kv_store.py)."""
    if k_cache.dtype != FP8_DTYPE and k_scale is None and v_scale is None:
        return False
    return check_kv_scales(k_cache, k_scale, v_scale)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x as an FP8 cache stores it: clamp(x.float() / scale, -448, 448) in e4m3 (round to
    nearest even). The clamp comes first: torch's cast turns values beyond 448 into NaN."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cached K or V as attention reads it: FP8 rows times `scale` in fp32, then rounded to
    `dtype` (q's); rows of any other dtype unchanged."""
    if x.dtype != FP8_DTYPE:
        return x
    return (x.float() * scale).to(dtype)


def round_trip_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """This step's K or V as an FP8 cache will give it back, for a prefill that attends to
    it without reading the cache."""
    return dequantize_kv(quantize_kv(x, scale), scale, dtype)


def load_scale(attn, kind: str, value: torch.Tensor, name: str) -> None:
    """A checkpoint's K or V scale (`kind` "k" / "v", tensor `name`) into an attention layer of an
    FP8 cache (model/loader.py)."""
    value = value.float().reshape(-1)
    if value.numel() != 1 or not torch.isfinite(value).all() or value.item() <= 0:
        raise ValueError(f"{name}: a KV-cache scale must be one positive finite number, got {value.tolist()[:4]}")
    getattr(attn, f"{kind}_scale").copy_(value)
    attn.kv_scales_from_checkpoint = True
