"""Which model class serves a checkpoint: config.json's `architectures` -> one family module,
imported on first use only."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    """A supported `architectures` entry: its model_type, transformers config class and nanovllm module."""

    model_type: str
    config_class: str
    module: str


ARCHITECTURES = {  # the supported ones
    "Qwen3ForCausalLM": Architecture("qwen3", "Qwen3Config", "nanovllm.model.families.qwen3"),
    "Qwen2ForCausalLM": Architecture("qwen2", "Qwen2Config", "nanovllm.model.families.qwen2"),
    "LlamaForCausalLM": Architecture("llama", "LlamaConfig", "nanovllm.model.families.llama"),
    "Qwen3MoeForCausalLM": Architecture("qwen3_moe", "Qwen3MoeConfig", "nanovllm.model.families.qwen3_moe"),
}


def architecture_name(architectures, model_type, where: str = "config.json") -> str:
    """The supported entry of `architectures` (config.json's list), checked against `model_type`."""
    names = [a for a in (architectures or []) if a in ARCHITECTURES]
    if not names:
        raise ValueError(f"unsupported model in {where}: architectures={list(architectures or [])}, "
                         f"model_type={model_type!r}; supported architectures: {', '.join(ARCHITECTURES)}")
    name = names[0]
    expected = ARCHITECTURES[name].model_type
    if model_type != expected:
        raise ValueError(f"{where}: architectures={list(architectures)} comes with model_type={expected!r}, "
                         f"got model_type={model_type!r}")
    return name


def model_class(hf_config):
    """The nanovllm class (a DecoderForCausalLM) for a config that checkpoint.load_hf_config accepted."""
    name = architecture_name(getattr(hf_config, "architectures", None), getattr(hf_config, "model_type", None))
    return getattr(importlib.import_module(ARCHITECTURES[name].module), name)


def decoder_options(hf_config):
    """The DecoderOptions its family reads from a transformers config (a ValueError if unsupported)."""
    return model_class(hf_config).options_from_config(hf_config)
