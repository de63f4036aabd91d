"""Tiny FP8 checkpoints for tests: a 16-bit tiny checkpoint re-saved in Qwen's block-FP8 format.

Every linear weight of the decoder layers (q/k/v/o, gate/up/down; Qwen3-MoE's experts too, one
`mlp.experts.<e>.<proj>.weight` + `.weight_scale_inv` pair per expert and projection) becomes
float8_e4m3fn in 128x128 blocks with a `weight_scale_inv` tensor, exactly as Qwen/Qwen3-8B-FP8 and
Qwen/Qwen3-30B-A3B-FP8 store them; embeddings, norms, the LM head and the MoE routers
(`mlp.gate`) stay as they were; config.json gains the quantization_config. Optionally the
checkpoint lists modules it leaves in 16 bits (`modules_to_not_convert`, as Qwen's 2507 FP8 MoE
checkpoints do: see qwen_moe_not_convert), and the KV-cache scales vLLM's checkpoints carry are added.
"""

from __future__ import annotations

import os
import re
import shutil

import torch
from helpers import edit_json, rewrite_safetensors
from safetensors.torch import load_file

from nanovllm.features.quantization.fp8_ops import quantize_weight_block_fp8

QWEN_FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 128]}
_LINEAR = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def qwen_moe_not_convert(num_layers: int) -> list[str]:
    """modules_to_not_convert as Qwen's FP8 Qwen3-MoE checkpoints (e.g. Qwen3-30B-A3B-*-2507-FP8)
    write it: the LM head, and per layer the two norms and the router."""
    names = ["lm_head"]
    for i in range(num_layers):
        names += [f"model.layers.{i}.input_layernorm", f"model.layers.{i}.mlp.gate",
                  f"model.layers.{i}.post_attention_layernorm"]
    return names


def quantize_checkpoint_fp8(src: str, dst: str, scale_dtype=torch.bfloat16, kv_scales: dict | None = None,
                            quantization_config: dict | None = None, not_convert: list[str] | None = None) -> str:
    """Copy the checkpoint folder `src` to `dst` with its linear weights in block FP8.

    kv_scales: {layer index: (k_scale, v_scale)} written as model.layers.<i>.self_attn.{k,v}_scale.
    not_convert: module names (whole dotted parts) left in 16 bits and written to the config's
    modules_to_not_convert.
    """
    shutil.copytree(src, dst, dirs_exist_ok=True)
    skip = [f".{m}." for m in not_convert or ()]

    def quantize(tensors):
        out = {}
        for name, t in tensors.items():
            if _LINEAR.search(name) and t.dim() == 2 and not any(m in f".{name}" for m in skip):
                w_q, scale_inv = quantize_weight_block_fp8(t.float(), scale_dtype=scale_dtype)
                out[name] = w_q
                out[name[:-len("weight")] + "weight_scale_inv"] = scale_inv
            else:
                out[name] = t
        for layer, (k, v) in (kv_scales or {}).items():
            out[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(float(k))
            out[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(float(v))
        return out

    def add_quantization_config(cfg):
        cfg["quantization_config"] = dict(quantization_config or QWEN_FP8_CONFIG)
        if not_convert is not None:
            cfg["quantization_config"]["modules_to_not_convert"] = list(not_convert)

    rewrite_safetensors(dst, quantize)
    edit_json(os.path.join(dst, "config.json"), add_quantization_config)
    return dst


def dequantized_weights(path: str) -> dict[str, torch.Tensor]:
    """The FP8 checkpoint's linear weights as real numbers (fp32), by our own dequantizer."""
    from nanovllm.features.quantization.fp8_ops import dequantize_weight_block_fp8

    tensors = load_file(os.path.join(path, "model.safetensors"))
    return {name: dequantize_weight_block_fp8(t, tensors[name[:-len("weight")] + "weight_scale_inv"])
            for name, t in tensors.items() if t.dtype == torch.float8_e4m3fn}


def make_peaked(src: str) -> str:
    """Rescale a tiny checkpoint in place so that its greedy choices mean something: linear and
    expert weights x0.3 (the tiny models' gain of ~3 per linear compounds errors as no trained
    model does) and the LM head x3 (peaked logits). Returns src."""

    def rescale(t):
        for name in t:
            if re.search(r"_proj\.weight$", name):
                t[name] = t[name] * 0.3
        t["lm_head.weight"] = t["lm_head.weight"] * 3

    rewrite_safetensors(src, rescale)
    return src
