"""Quantized weight schemes, one module each (`fp8.py`: FP8 weights; `fp8_ops.py`: its arithmetic
in plain torch and the dispatchers to the kernels of nanovllm/kernels/fp8_gemm.py; `fp8_moe.py`:
FP8 MoE experts; `fp8_kv.py`: the FP8 KV cache's options and scale calibration; `int4.py`: INT4
weight-only GPTQ / AWQ / compressed-tensors checkpoints, `int4_formats.py` and `int4_loading.py`
their storage, nanovllm/kernels/w4a16.py their GEMM; `model_steps.py`: what every scheme does to a
whole model: quantize it, draw dummy weights, finish loading).

Each scheme is a model/quant.py `QuantScheme` (the linear-method hook it plugs into), named in
`SCHEMES` by its quantization name. `resolve_quantization` turns what the user asked for (`LLM(quantization=...)`)
and what the checkpoint says (config.json's `quantization_config`) into one scheme, or a clear
error, before any weight loads.
"""

from __future__ import annotations

from nanovllm.features.quantization.fp8 import Fp8Config
from nanovllm.features.quantization.int4 import Int4Config

# Methods vLLM knows that nano-vllm does not run: named in the error instead of "unknown".
_KNOWN_ELSEWHERE = ("awq_marlin", "gptq_marlin", "marlin", "bitsandbytes", "compressed_tensors", "modelopt", "modelopt_fp4", "fbgemm_fp8", "gguf", "hqq", "mxfp4",
                    "torchao", "experts_int8", "deepspeedfp", "tpu_int8", "quark", "moe_wna16", "eetq", "aqlm")


# quantization name -> (the checkpoint's quantization_config dict, or None to quantize 16-bit
# weights at load time) -> scheme.
SCHEMES = {"fp8": Fp8Config.resolve, "gptq": Int4Config.gptq, "awq": Int4Config.awq,
           "compressed-tensors": Int4Config.compressed_tensors}


def resolve_quantization(checkpoint_config, requested: str | None):
    """The weight scheme of an engine (a model/quant.py `QuantScheme`), or None for unquantized
    weights.

    checkpoint_config: config.json's `quantization_config` (dict or None). requested:
    `LLM(quantization=...)`: None (follow the checkpoint) or a registered name ("fp8": the
    checkpoint's FP8 format if it has one, else quantize its 16-bit weights at load time).
    """
    supported = ", ".join(SCHEMES)
    if requested is not None and requested not in SCHEMES:
        where = "is not supported by nano-vllm" if requested in _KNOWN_ELSEWHERE else "is unknown"
        raise ValueError(f"quantization={requested!r} {where}; supported: {supported} "
                         f"(or None to follow the checkpoint)")
    if checkpoint_config is not None and not isinstance(checkpoint_config, dict):
        checkpoint_config = checkpoint_config.to_dict() if hasattr(checkpoint_config, "to_dict") else None
    if checkpoint_config:
        method = checkpoint_config.get("quant_method")
        if method not in SCHEMES:
            raise ValueError(f"the checkpoint is quantized with quant_method={method!r}, which nano-vllm does not "
                             f"load; supported: {supported}")
        return SCHEMES[method](checkpoint_config)
    return None if requested is None else SCHEMES[requested](None)
