"""Features: each a module or small package that plugs into a hook the core declares
(`nanovllm/core/hooks.py`, the `Executor` in `core/executor.py`, the linear method and attention
backend protocols in `model/`).

This file is the one place that wires them: the fronts call the functions below, which import a
feature only when a config option or a request turns it on, so a plain generate loads none.
"""

from __future__ import annotations

# ---------------------------------------------------------------- model: quantization, FP8 KV cache, MoE


def quantization_scheme(checkpoint_config, requested: str | None):
    """The weight scheme (model/quant.py's `QuantScheme`) for `LLM(quantization=...)` and the
    checkpoint's `quantization_config`, or None when neither asks for one."""
    if requested is None and not checkpoint_config:
        return None
    from nanovllm.features.quantization import resolve_quantization

    return resolve_quantization(checkpoint_config, requested)


def kv_cache_dtype(name: str, model_dtype):
    """The KV cache's element type for `LLM(kv_cache_dtype=name)`: the model's for "auto", else
    the FP8 cache's (features/quantization/fp8_kv.py; a ValueError for unknown names)."""
    if name == "auto":
        return model_dtype
    from nanovllm.features.quantization.fp8_kv import kv_cache_torch_dtype

    return kv_cache_torch_dtype(name, model_dtype)


def kv_scale_calibrator(calculate_kv_scales: bool):
    """The attention layers' `KVScaleCalibrator` for `LLM(calculate_kv_scales=True)`, else None."""
    if not calculate_kv_scales:
        return None
    from nanovllm.features.quantization.fp8_kv import calibrate_kv_scales

    return calibrate_kv_scales


def sparse_mlp(decoder_options):
    """The MoE block factory (model/decoder.py's `SparseMlpFactory`: features/moe.py) when the
    model (its `DecoderOptions`) has mixture-of-experts layers, else None."""
    if not decoder_options.moe_layers:
        return None
    from nanovllm.features.moe import SparseMoeBlock

    return SparseMoeBlock.from_options
