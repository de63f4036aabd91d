"""What an attention backend is, which ones exist, and the choice of one per engine.

Every backend computes the same function: each new token attends causally to its sequence's
K/V in the layer's paged cache (paged_kv.py). Causality is aligned bottom-right: with `c`
cached tokens, new token `j` sees K/V positions `0 .. c + j`. Backends attend over the values
the cache gives back, also where they could use this step's K/V directly (a prefill without
cached tokens): with an FP8 cache a prefix hit, a later chunk or a recomputed sequence then sees
bitwise the same K/V as the first computation did.

- `torch`:      CPU reference; SDPA over K/V gathered through the block table.
- `triton`:     CUDA without flash-attn; aten's FlashAttention-2 varlen prefill, Triton decode.
- `flash_attn`: the flash-attn package, when importable (no FP8 cache).

Each lives in a module of its own, imported when chosen. A CPU engine runs the torch backend,
the only one its config allows, without loading this module (core/cuda_runtime.py does).
"""

from __future__ import annotations

import importlib
import logging
from typing import Protocol

import torch

from nanovllm.model.attention.backend import flash_attn_available
from nanovllm.model.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    name: str
    fp8_cache: bool  # whether it reads and writes a float8_e4m3fn cache (with k_scale / v_scale)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
        """Write this step's K/V [tokens, kv_heads, head_dim] into their slots (-1: skip)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """The attention output [tokens, heads, head_dim] (this step's K/V already stored)."""

# name -> (module, class), imported when chosen
BACKENDS = {
    "torch": ("nanovllm.model.attention.torch_backend", "TorchBackend"),
    "triton": ("nanovllm.model.attention.triton_backend", "TritonBackend"),
    "flash_attn": ("nanovllm.model.attention.flash_attn_backend", "FlashAttnBackend"),
}


def backend_class(name: str) -> type:
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def _check_forced(forced: str, device: str, block_size: int, fp8: bool) -> None:
    if forced != "torch" and device != "cuda":
        raise ValueError(f"attention_backend={forced!r} needs CUDA; this engine runs on {device}")
    if forced == "flash_attn" and block_size % 256:
        raise ValueError(f"attention_backend='flash_attn' needs kvcache_block_size to be a multiple "
                         f"of 256, got {block_size}")
    if fp8 and not backend_class(forced).fp8_cache:
        raise ValueError(f"attention_backend={forced!r} does not support kv_cache_dtype='fp8' (an FP8 KV "
                         f"cache); use attention_backend='triton'")


_CACHE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)


def select_backend(device: str, block_size: int, forced: str | None = None,
                   kv_cache_dtype: torch.dtype | None = None) -> AttentionBackend:
    """The attention backend of an engine, chosen once: `forced`, else torch on CPU, flash_attn
    on CUDA when importable and the block size suits it, else triton. An FP8 cache
    (`kv_cache_dtype` float8_e4m3fn) never gets a backend without FP8 support."""
    if kv_cache_dtype not in _CACHE_DTYPES:
        raise ValueError(f"a KV cache of {kv_cache_dtype} is not supported; one of {_CACHE_DTYPES[1:]}")
    fp8 = kv_cache_dtype == torch.float8_e4m3fn
    if forced is not None:
        _check_forced(forced, device, block_size, fp8)
        name = forced
    elif device != "cuda":
        name = "torch"
    elif flash_attn_available() and block_size % 256 == 0 and not fp8:
        name = "flash_attn"
    else:
        name = "triton"
    backend = backend_class(name)()
    logger.info("attention backend: %s", name)
    return backend
