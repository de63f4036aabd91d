"""Paged attention: the layer (layer.py), the per-step metadata the core builds (metadata.py),
the backend protocol and the choice of a backend (backend.py), one module per backend
(torch_backend.py, triton_backend.py, flash_attn_backend.py), and the paged cache's store,
gather and FP8 encoding in plain torch (paged_kv.py)."""

from nanovllm.model.attention.backend import AttentionBackend, flash_attn_available, select_backend
from nanovllm.model.attention.layer import Attention, KVScaleCalibrator
from nanovllm.model.attention.metadata import AttentionMetadata, host_to_device, prefill_metadata

__all__ = ["Attention", "AttentionBackend", "AttentionMetadata", "KVScaleCalibrator", "flash_attn_available",
           "host_to_device", "prefill_metadata", "select_backend"]
