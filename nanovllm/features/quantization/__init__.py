"""Quantized weight schemes, one module each (`fp8.py`: FP8 weights; `fp8_ops.py`: its arithmetic
in plain torch and the dispatchers to the kernels of nanovllm/kernels/fp8_gemm.py).

`resolve_quantization` turns what the user asked for (`LLM(quantization=...)`) and what the
checkpoint says (config.json's `quantization_config`) into one scheme, or a clear error, before
any weight loads.
"""

from __future__ import annotations

QUANTIZATION_METHODS = ("fp8",)
# Methods vLLM knows that nano-vllm does not run: named in the error instead of "unknown".
_KNOWN_ELSEWHERE = ("awq", "awq_marlin", "gptq", "gptq_marlin", "marlin", "bitsandbytes", "compressed-tensors",
                    "compressed_tensors", "modelopt", "modelopt_fp4", "fbgemm_fp8", "gguf", "hqq", "mxfp4",
                    "torchao", "experts_int8", "deepspeedfp", "tpu_int8", "quark", "moe_wna16", "eetq", "aqlm")


def resolve_quantization(checkpoint_config, requested: str | None):
    """The weight scheme of an engine: an `Fp8Config`, or None for unquantized weights.

    checkpoint_config: config.json's `quantization_config` (dict or None). requested:
    `LLM(quantization=...)`: None (follow the checkpoint) or "fp8" (the checkpoint's FP8 format
    if it has one, else quantize its 16-bit weights at load time).
    """
    from nanovllm.features.quantization.fp8 import Fp8Config

    if requested is not None and requested not in QUANTIZATION_METHODS:
        where = "is not supported by nano-vllm" if requested in _KNOWN_ELSEWHERE else "is unknown"
        raise ValueError(f"quantization={requested!r} {where}; supported: {', '.join(QUANTIZATION_METHODS)} "
                         f"(or None to follow the checkpoint)")
    if checkpoint_config is not None and not isinstance(checkpoint_config, dict):
        checkpoint_config = checkpoint_config.to_dict() if hasattr(checkpoint_config, "to_dict") else None
    if checkpoint_config:
        method = checkpoint_config.get("quant_method")
        if method != "fp8":
            raise ValueError(f"the checkpoint is quantized with quant_method={method!r}, which nano-vllm does not "
                             f"load; supported: FP8 (quant_method 'fp8', Qwen's block format)")
        return Fp8Config.from_checkpoint(checkpoint_config)
    if requested == "fp8":
        return Fp8Config.online()
    return None
