"""Paged attention: the layer, the per-step metadata, the backends (chosen in selection.py) and the
paged cache's store, gather (paged_kv.py) and FP8 encoding (fp8_cache.py) in plain torch."""

from nanovllm.model.attention.backend import flash_attn_available
from nanovllm.model.attention.layer import Attention
from nanovllm.model.attention.metadata import AttentionMetadata, host_to_device, prefill_metadata

__all__ = ["Attention", "AttentionMetadata", "flash_attn_available", "host_to_device", "prefill_metadata"]
