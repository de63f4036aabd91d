"""Config's checks that a plain engine (default options, CPU, LLM's features wired in) never runs:
vLLM's keywords and unknown ones, a forced attention backend, an explicit dtype, FP8 on CUDA and
a bare LLMEngine's refusals. config.py reaches them through CONFIG_CHECKS (wiring/'s loader)."""

from __future__ import annotations

import torch

from nanovllm.limits import clip_repr
from nanovllm.model.attention.backend import flash_attn_available
from nanovllm.vllm_keywords import translate_vllm_keywords

_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


def known_keywords(kwargs: dict, known: set) -> dict:
    """`kwargs` with vLLM's names and vLLM-only keywords read (vllm_keywords.py); every keyword
    still unknown is named in one TypeError."""
    kwargs = translate_vllm_keywords(kwargs)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"LLM() got unknown keyword argument(s): {', '.join(unknown)}. "
                        f"Known: {', '.join(sorted(known))}")
    return kwargs


def check_backend(config) -> None:
    """A forced attention_backend, at construction."""
    if config.attention_backend == "flash_attn" and config.kvcache_block_size % 256:
        raise ValueError(f"attention_backend='flash_attn' needs kvcache_block_size to be a multiple of 256, "
                         f"got {config.kvcache_block_size}")


def check_backend_device(config) -> None:
    """A forced attention_backend, once the device is known."""
    backend = config.attention_backend
    if backend in ("triton", "flash_attn") and config.device != "cuda":
        raise ValueError(f"attention_backend={backend!r} needs CUDA; this engine runs on {config.device}")
    if backend == "flash_attn" and not flash_attn_available():
        raise ValueError("attention_backend='flash_attn' but the flash_attn package cannot be imported")


def check_fp8_device(config) -> None:
    """FP8 weights or KV cache on CUDA need compute capability 8.9."""
    if config.quant is not None or config.kv_dtype == torch.float8_e4m3fn:
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            raise ValueError(f"FP8 weights or KV cache need a GPU of compute capability 8.9 or later "
                             f"(Ada, Hopper); this one is {major}.{minor}")


def resolve_dtype(dtype, hf) -> torch.dtype:
    """The model's dtype: `dtype` (None / 'auto': the checkpoint's, else bfloat16)."""
    if dtype is None or dtype == "auto":
        dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or "bfloat16"
    resolved = dtype if isinstance(dtype, torch.dtype) else _DTYPES.get(str(dtype).removeprefix("torch."))
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype={clip_repr(dtype)}: must be None, 'auto', float32, bfloat16 or float16")
    return resolved


def refuse_bare_engine(config, checkpoint_quant, opts) -> None:
    """Without the features LLM wires in (a bare LLMEngine), a model or option that needs one is a
    ValueError naming it."""
    p = config.parallel
    needs = {"quantized weights": checkpoint_quant or config.quantization.method is not None,
             "calculate_kv_scales=True": config.quantization.calculate_kv_scales,
             "a mixture-of-experts model": opts.moe_layers,
             "speculative_config": config.speculative_config is not None,
             "enable_lora=True": config.lora.enable_lora,
             "tensor_parallel_size > 1, data_parallel_size > 1 or distributed_executor_backend='ray' / "
             "'external_launcher'": p.tensor_parallel_size * p.data_parallel_size > 1
             or p.distributed_executor_backend not in (None, "mp")}
    if wanted := [what for what, needed in needs.items() if needed]:
        raise ValueError(f"{wanted[0]} need(s) the features that LLM wires in: create LLM(model, ...), "
                         f"not a bare LLMEngine")
