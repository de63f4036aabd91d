"""A PEFT LoRA adapter folder (`adapter_config.json` + `adapter_model.safetensors`), read and
checked: which projections of which layers it changes, each one's A [r, in] and B [out, r], and
its scaling (lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA; per module with PEFT's
rank_pattern / alpha_pattern).

Tensor names are PEFT's: `base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_A.weight`
(and `lora_B`). What a plain LoRA does not cover is refused with the reason (DoRA, LoRA biases,
modules_to_save, embeddings, a rank above max_lora_rank, a module the model lacks), before the
adapter is used.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open

# The projections an adapter may change: our packed layer and the part it fills.
TARGETS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
           "down_proj": ("down_proj", 0)}
_NAME = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_REFUSED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save (full copies of modules)",
            "layer_replication": "layer_replication", "trainable_token_indices": "trainable token indices"}


@dataclass
class LoraWeights:
    """One projection's update: delta W = scaling * B @ A."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int  # the largest of its modules'
    weights: dict[tuple[int, str], LoraWeights]  # (layer, projection name) -> its update


def _pattern_value(pattern: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key the module's name ends with."""
    for key, value in (pattern or {}).items():
        if re.search(rf"(^|\.){key}$", module):
            return value
    return default


def read_config(path: str) -> dict:
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"LoRA adapter {path!r}: no adapter_config.json (a PEFT adapter folder is needed)")
    with open(file) as f:
        config = json.load(f)
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type={config.get('peft_type')!r}, only LORA is supported")
    for key, what in _REFUSED.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {path!r}: {what} is not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise ValueError(f"LoRA adapter {path!r}: LoRA biases (bias={config.get('bias')!r}) are not supported")
    return config


def load_adapter(name: str, path: str, max_rank: int, num_layers: int) -> LoraAdapter:
    """The adapter at `path` (ValueError / FileNotFoundError naming what does not fit)."""
    config = read_config(path)
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"LoRA adapter {path!r}: no adapter_model.safetensors (pickle files are not read)")
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(file, "pt") as f:
        for key in f.keys():
            m = _NAME.match(key)
            if m is None or m[3] not in TARGETS:
                raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} is not a LoRA update of q/k/v/o_proj or "
                                 f"gate/up/down_proj of a decoder layer")
            layer = int(m[1])
            if layer >= num_layers:
                raise ValueError(f"LoRA adapter {path!r}: {key!r} names layer {layer}, the model has {num_layers}")
            parts.setdefault((layer, m[3]), {})[m[4]] = f.get_tensor(key)
    weights, rank = {}, 0
    for (layer, proj), t in sorted(parts.items()):
        if set(t) != {"A", "B"} or t["A"].shape[0] != t["B"].shape[1]:
            raise ValueError(f"LoRA adapter {path!r}: layer {layer} {proj} needs lora_A [r, in] and lora_B [out, r]")
        r = t["A"].shape[0]
        module = f"model.layers.{layer}.{'self_attn' if proj in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{proj}"
        if r != _pattern_value(config.get("rank_pattern"), module, config.get("r", r)):
            raise ValueError(f"LoRA adapter {path!r}: {module} has rank {r}, its config says otherwise")
        if r > max_rank:
            raise ValueError(f"LoRA adapter {path!r}: rank {r} is above max_lora_rank={max_rank}")
        alpha = _pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", r))
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        weights[(layer, proj)] = LoraWeights(t["A"].float(), t["B"].float(), float(scaling))
        rank = max(rank, r)
    if not weights:
        raise ValueError(f"LoRA adapter {path!r}: it holds no LoRA weights")
    return LoraAdapter(name, path, rank, weights)
