"""Whether a checkpoint's config.json describes a model this machine can hold, checked before any
allocation: values in their ranges (rope_theta = 0 would load and emit garbage) and the weights'
size against the device's memory (num_hidden_layers = 10**6 would grind until memory runs out;
vocab_size = 10**9 would fail in the allocator with a raw message)."""

from __future__ import annotations

import os

import torch

from nanovllm.model import registry


def check_model_fits(hf_config, dtype: torch.dtype, fp8_layers: bool, device: str, tp: int, dp: int) -> None:
    """rope_theta and rms_norm_eps (as the family reads them) positive and finite, and the weights'
    size against the device (each GPU holds 1/tp of them; on the CPU the ranks and replicas
    share the RAM): a ValueError naming the config.json field, before any allocation."""
    opts = registry.decoder_options(hf_config)
    for name, value in (("rope_theta", opts.rope_theta), ("rms_norm_eps", opts.rms_norm_eps)):
        if not 0 < value < float("inf"):
            raise ValueError(f"config.json: {name}={value!r}: must be a positive finite number")
    parts = weight_bytes(hf_config, dtype, fp8_layers)
    need = sum(parts.values()) * (dp if device == "cpu" else 1) // (1 if device == "cpu" else tp)
    have, what = device_memory(device)
    if need > have:
        field = max(parts, key=parts.get)
        raise ValueError(f"config.json: {field}={getattr(hf_config, field)} (hidden_size={hf_config.hidden_size}): "
                         f"the weights alone need {need / 2**30:.1f} GiB, more than the {have / 2**30:.1f} GiB "
                         f"{what}")


def weight_bytes(hf_config, dtype: torch.dtype, fp8_layers: bool) -> dict[str, int]:
    """A lower bound of the model's weight bytes, in two parts named by the config.json field
    that scales them: "vocab_size" (embedding and LM head), "num_hidden_layers" (the layers)."""
    o = registry.decoder_options(hf_config)
    h, q, kv = o.hidden_size, o.num_heads * o.head_dim, o.num_kv_heads * o.head_dim
    dense_layers = o.num_layers - len(o.moe_layers)
    params = o.num_layers * (h * (q + 2 * kv) + q * h) + dense_layers * 3 * h * o.intermediate_size
    if o.moe is not None:
        params += len(o.moe_layers) * o.moe.num_experts * (3 * h * o.moe.intermediate_size + h)
    size = torch.tensor([], dtype=dtype).element_size()
    return {"vocab_size": o.vocab_size * h * (1 if o.tie_word_embeddings else 2) * size,
            "num_hidden_layers": params * (1 if fp8_layers else size)}


def device_memory(device: str) -> tuple[int, str]:
    """(bytes, what they are): one GPU's total memory, or on the CPU the RAM available now."""
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, "memory of one GPU"
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024, "available RAM"
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), "available RAM"
