"""Tiny FP8 checkpoints for tests: a 16-bit tiny checkpoint re-saved in Qwen's block-FP8 format.

Every linear weight of the decoder layers (q/k/v/o, gate/up/down; experts too) becomes
float8_e4m3fn in 128x128 blocks with a `weight_scale_inv` tensor, exactly as Qwen/Qwen3-8B-FP8
stores them; embeddings, norms and the LM head stay as they were; config.json gains the
quantization_config. Optionally the KV-cache scales vLLM's checkpoints carry are added.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

from nanovllm.layers.quantization.fp8_ops import quantize_weight_block_fp8

QWEN_FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 128]}
_LINEAR = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def quantize_checkpoint_fp8(src: str, dst: str, scale_dtype=torch.bfloat16, kv_scales: dict | None = None,
                            quantization_config: dict | None = None) -> str:
    """Copy the checkpoint folder `src` to `dst` with its linear weights in block FP8.

    kv_scales: {layer index: (k_scale, v_scale)} written as model.layers.<i>.self_attn.{k,v}_scale.
    """
    shutil.copytree(src, dst, dirs_exist_ok=True)
    file = os.path.join(dst, "model.safetensors")
    tensors = load_file(file)
    out = {}
    for name, t in tensors.items():
        if _LINEAR.search(name) and t.dim() == 2:
            w_q, scale_inv = quantize_weight_block_fp8(t.float(), scale_dtype=scale_dtype)
            out[name] = w_q
            out[name[:-len("weight")] + "weight_scale_inv"] = scale_inv
        else:
            out[name] = t
    for layer, (k, v) in (kv_scales or {}).items():
        out[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(float(k))
        out[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(float(v))
    save_file({k: v.contiguous() for k, v in out.items()}, file, metadata={"format": "pt"})
    cfg_file = os.path.join(dst, "config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = dict(quantization_config or QWEN_FP8_CONFIG)
    with open(cfg_file, "w") as f:
        json.dump(cfg, f, indent=2)
    return dst


def dequantized_weights(path: str) -> dict[str, torch.Tensor]:
    """The FP8 checkpoint's linear weights as real numbers (fp32), by our own dequantizer."""
    from nanovllm.layers.quantization.fp8_ops import dequantize_weight_block_fp8

    tensors = load_file(os.path.join(path, "model.safetensors"))
    return {name: dequantize_weight_block_fp8(t, tensors[name[:-len("weight")] + "weight_scale_inv"])
            for name, t in tensors.items() if t.dtype == torch.float8_e4m3fn}
